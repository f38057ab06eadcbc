"""A decode step of a :class:`kbit.hf.StaticDecoder`, kernel by kernel, with the bytes each must read (issue 36).

How: :class:`StepRecorder` opens a ``record_function`` range around every module call of one eager step (forward
hooks on the linear layers, embeddings, MoE blocks, routers, experts, attention and norm modules) and around the
glue ops of the fast decode step (the functions ``kbit.hf.fast_decode`` calls, its attention, the decoder's token
pick, the MoE block's routing and experts; patched for the step and restored after it), and notes what each range
must read: a module's weights (embeddings: the rows looked up; experts: the experts the step touched, counted
after it), the KV cache at the step's length for attention. :func:`profile_decoder` runs, in one
``torch.profiler`` run, one CUDA-graph replay of the step (for a decoder with a graph) and that eager step: the
replay's kernels take the eager step's ranges by order (the graph holds the same launches) and give the timeline,
since the eager step's gaps are host launch time the graph does not have. The profiler itself adds time; the step
time that the roofline % uses is the unprofiled graph replay when the caller passes it.

    prof = profile_decoder(dec, ctx=512, ceiling_tbps=3.07, step_ms=graph_ms, meta={"title": "qwen3-8b k=4 B=1"})
    print(step_report.format_report(prof))
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

import kbit.hf.fast_decode as fast_decode
import kbit.nn.moe as nn_moe
from kbit.bench.step_trace import (
    Range,
    StepProfile,
    attribute,
    build_profile,
    drop_far,
    range_name,
    split_run,
    subtree,
    trace_events,
    transfer,
)
from kbit.hf.decode import StaticDecoder
from kbit.nn import KbitLinear, KbitMoE

__all__ = ["StepRecorder", "instrument", "kv_layer_bytes", "module_bytes", "module_kind", "profile_decoder"]

#: fast_decode's glue functions wrapped during the profiled step: name -> (kind, positions of weight arguments)
GLUE = {"rms_norm": ("norm/glue", (1,)), "add_rms_norm": ("norm/glue", (2,)), "rope_append": ("norm/glue", ()),
        "silu_mul": ("norm/glue", ()), "combine_add_rms_norm": ("norm/glue", (2,))}
_LAYER = re.compile(r"layers\.(\d+)\.")


def module_bytes(module: nn.Module, recurse: bool = True) -> int:
    """Bytes of a module's parameters and buffers (each tensor once)."""
    seen, total = set(), 0
    for t in list(module.parameters(recurse=recurse)) + list(module.buffers(recurse=recurse)):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _expert_bytes(module: nn.Module, E: int) -> tuple[int, int]:
    """(bytes per expert, bytes read once) of an expert stack holder: tensors with a leading dimension E are per
    expert, codebooks and the rest once; the router's weight and correction bias are the router's, a shared
    expert's weights its own modules'."""
    per, once = 0, 0
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t is None or name.split(".")[-1] in ("router_weight", "correction_bias") or name.startswith("shared_"):
            continue
        if t.dim() >= 1 and t.shape[0] == E and "codebook" not in name:
            per += t.numel() * t.element_size() // E
        else:
            once += t.numel() * t.element_size()
    return per, once


def _is_moe_block(m: nn.Module) -> bool:
    return isinstance(m, KbitMoE) or (hasattr(m, "gate") and hasattr(m, "experts")
                                      and isinstance(m.experts, nn.Module))


def module_kind(name: str, m: nn.Module, parent: nn.Module | None = None) -> str | None:
    """The kind (:data:`kbit.bench.step_trace.KINDS`) of a module call, None for modules not given a range."""
    cls = type(m).__name__
    if name.split(".")[-1] == "lm_head":
        return "lm_head"
    if _is_moe_block(m) or (parent is not None and _is_moe_block(parent) and m is getattr(parent, "gate", None)):
        return "MoE routing"
    if parent is not None and _is_moe_block(parent) and m is getattr(parent, "experts", None):
        return "k-bit GEMV" if "Kbit" in cls else "bf16 GEMV"
    if isinstance(m, KbitLinear):
        return "k-bit GEMV"
    if isinstance(m, nn.Linear):
        return "bf16 GEMV"
    if cls.endswith("Attention"):
        return "attention"
    if isinstance(m, nn.Embedding) or "Norm" in cls or cls.endswith("RotaryEmbedding"):
        return "norm/glue"
    return None


class StepRecorder:
    """The ranges of one profiled step (``ranges``: id -> :class:`~kbit.bench.step_trace.Range`).

    A range opened inside another one that counts the same weight (``key``) takes those bytes over, so a module
    called by a wrapped function is counted once, on the innermost range."""

    def __init__(self, kv_layer_bytes: int = 0):
        self.ranges: dict[int, Range] = {}
        self.kv_layer_bytes = int(kv_layer_bytes)
        self._stack: list[tuple[Range, object, int, record_function]] = []
        self._pending: list[tuple[Range, torch.Tensor, int, int]] = []
        self.layer = 0
        self.moe: list[KbitMoE] = []  # the KbitMoE blocks being called (their experts wrapper reads the stack)

    def open(self, label: str, kind: str, nbytes: int = 0, key=None) -> Range:
        for i, (outer, okey, obytes, rf) in enumerate(self._stack):
            if key is not None and okey is key:  # the weight moves to the innermost range that reads it
                outer.nbytes -= min(obytes, int(nbytes))
                self._stack[i] = (outer, None, 0, rf)
        m = _LAYER.search(label)
        if m:
            self.layer = int(m.group(1))
        r = Range(len(self.ranges), label, kind, int(nbytes), self._stack[-1][0].id if self._stack else None)
        self.ranges[r.id] = r
        rf = record_function(range_name(r.id, label))
        rf.__enter__()
        self._stack.append((r, key, int(nbytes) if key is not None else 0, rf))
        return r

    def close(self) -> None:
        if self._stack:
            self._stack.pop()[3].__exit__(None, None, None)

    @contextlib.contextmanager
    def range(self, label: str, kind: str, nbytes: int = 0, key=None):
        r = self.open(label, kind, nbytes, key)
        try:
            yield r
        finally:
            self.close()

    def defer_experts(self, r: Range, ids: torch.Tensor, per_expert: int, once: int) -> None:
        """The bytes of ``r``: the distinct experts in ``ids`` (counted by :meth:`finish`) times ``per_expert``."""
        self._pending.append((r, ids, per_expert, once))

    def finish(self) -> dict[int, Range]:
        """Close what is open, count the touched experts (a device sync: after the profiled step), return ranges."""
        while self._stack:
            self.close()
        for r, ids, per, once in self._pending:
            r.nbytes += int(torch.unique(ids).numel()) * per + once
        self._pending.clear()
        return self.ranges

    def wrap(self, fn, label_of, kind, bytes_of=None):
        """``fn`` inside a range: ``label_of(args)`` its label, ``kind`` a kind or ``kind(args)``, ``bytes_of(args)``
        -> ``(bytes, key)``."""
        def wrapped(*args, **kwargs):
            nbytes, key = bytes_of(args) if bytes_of is not None else (0, None)
            with self.range(label_of(args), kind(args) if callable(kind) else kind, nbytes, key):
                return fn(*args, **kwargs)
        wrapped.__wrapped__ = fn
        return wrapped


def _names(dec: StaticDecoder) -> dict[int, str]:
    names = {id(m): n.removeprefix("model.") for n, m in dec.model.named_modules()}
    fast = dec._fast
    if fast is not None:
        for i, (qkv, gu) in enumerate(zip(fast.qkv, fast.gate_up, strict=True)):
            if qkv is not None:
                names[id(qkv[0])] = f"layers.{i}.self_attn.qkv(fused)"
            if gu is not None:
                names[id(gu[0])] = f"layers.{i}.mlp.gate_up(fused)"
    return names


def _call_bytes(m: nn.Module, kind: str, args) -> tuple[int, object]:
    if isinstance(m, nn.Embedding):
        ids = args[0] if args and isinstance(args[0], torch.Tensor) else None
        return (0 if ids is None else ids.numel() * m.embedding_dim * m.weight.element_size()), None
    if isinstance(m, KbitMoE):
        w = m.router_weight  # keyed: the fused router's range (route_hidden) takes these bytes over
        return (0 if w is None else w.numel() * w.element_size()), w
    if kind == "attention" or _is_moe_block(m):
        return 0, None
    return module_bytes(m), m


def _hook_modules(rec: StepRecorder, dec: StaticDecoder, names: dict[int, str]) -> list:
    """Forward pre/post hooks opening a range per call of every module with a kind; returns the handles."""
    handles, parents = [], {}
    for m in dec.model.modules():
        for c in m.children():
            parents[id(c)] = m
    mods = list(dec.model.modules())
    if dec._fast is not None:
        mods += [g[0] for g in dec._fast.qkv + dec._fast.gate_up if g is not None]
    for m in mods:
        name = names.get(id(m), type(m).__name__)
        parent = parents.get(id(m))
        kind = module_kind(name, m, parent)
        if kind is None:
            continue
        experts = parent is not None and _is_moe_block(parent) and m is getattr(parent, "experts", None)

        def pre(mod, args, name=name, kind=kind, experts=experts, parent=parent):
            if experts and len(args) > 1 and isinstance(args[1], torch.Tensor):  # transformers: (x, top_k_index, w)
                r = rec.open(name, kind)
                E = int(getattr(parent.gate, "num_experts", 0) or parent.gate.weight.shape[0])
                rec.defer_experts(r, args[1], *_expert_bytes(mod, E))
                return
            nbytes, key = _call_bytes(mod, kind, args)
            if kind == "attention":
                nbytes = rec.kv_layer_bytes
            rec.open(name, kind, nbytes, key)
            if isinstance(mod, KbitMoE):
                rec.moe.append(mod)

        def post(mod, args, out):
            if isinstance(mod, KbitMoE) and rec.moe:
                rec.moe.pop()
            rec.close()

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
        if isinstance(m, KbitMoE):  # the fast step calls it without __call__ (the norm in its router's launch)
            handles.append(_HookedMethod(m, "forward_add_norm", pre, post))
    return handles


class _HookedMethod:
    """``m.<name>`` run between the module's pre and post hooks, as an instance attribute until ``remove()``."""

    def __init__(self, m: nn.Module, name: str, pre, post):
        fn = getattr(m, name)

        def wrapped(*args, **kwargs):
            pre(m, args)
            try:
                return fn(*args, **kwargs)
            finally:
                post(m, args, None)
        self.m, self.name = m, name
        setattr(m, name, wrapped)

    def remove(self):
        vars(self.m).pop(self.name, None)


@contextlib.contextmanager
def _patched(obj, name: str, value):
    """``obj.name = value`` for the duration (an instance attribute is deleted again, a module global restored)."""
    had = name in vars(obj)
    old = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def _glue_patches(rec: StepRecorder, dec: StaticDecoder, names: dict[int, str], stack: contextlib.ExitStack):
    def weight_bytes(pos):
        return lambda args: (sum(args[i].numel() * args[i].element_size() for i in pos
                                 if i < len(args) and isinstance(args[i], torch.Tensor)), None)

    for fname, (kind, pos) in GLUE.items():
        fn = getattr(fast_decode, fname)
        stack.enter_context(_patched(fast_decode, fname, rec.wrap(
            fn, lambda args, f=fname: f"layers.{rec.layer}.{f}", kind, weight_bytes(pos))))

    def linear_bytes(args):  # (x, residual, norm weight, eps, lin): the norm's weight and the module's
        lin = args[4]
        return weight_bytes((2,))(args)[0] + module_bytes(lin), lin

    stack.enter_context(_patched(fast_decode, "add_rms_norm_linear", rec.wrap(
        fast_decode.add_rms_norm_linear, lambda args: names.get(id(args[4]), "linear") + "+norm",
        lambda args: "k-bit GEMV" if isinstance(args[4], KbitLinear) else "bf16 GEMV", linear_bytes)))
    if dec._fast is not None:
        stack.enter_context(_patched(dec._fast, "_attend", rec.wrap(
            dec._fast._attend, lambda args: f"layers.{rec.layer}.attention", "attention",
            lambda args: (rec.kv_layer_bytes, None))))
    stack.enter_context(_patched(dec, "_pick", rec.wrap(dec._pick, lambda args: "sample", "sampling")))
    stack.enter_context(_patched(nn_moe, "route", rec.wrap(
        nn_moe.route, lambda args: f"layers.{rec.layer}.mlp.route", "MoE routing")))
    stack.enter_context(_patched(nn_moe, "route_hidden", rec.wrap(  # the router's product + routing, one launch
        nn_moe.route_hidden, lambda args: f"layers.{rec.layer}.mlp.route", "MoE routing",
        lambda args: (args[1].numel() * args[1].element_size(), args[1]))))
    stack.enter_context(_patched(nn_moe, "moe_experts", _experts_wrapper(rec, nn_moe.moe_experts)))


def _experts_wrapper(rec: StepRecorder, fn):
    """kbit.nn.moe's ``moe_experts`` in a range whose bytes are the experts the step's routing touched."""
    def wrapped(hidden, routing, *args, **kwargs):
        r = rec.open(f"layers.{rec.layer}.mlp.experts", "k-bit GEMV")
        try:
            moe = rec.moe[-1] if rec.moe else None
            if moe is not None:
                rec.defer_experts(r, routing.topk_ids, *_expert_bytes(moe, moe.num_experts))
            return fn(hidden, routing, *args, **kwargs)
        finally:
            rec.close()
    wrapped.__wrapped__ = fn
    return wrapped


def kv_layer_bytes(dec: StaticDecoder, length: int) -> int:
    """Bytes of one layer's keys and values at ``length`` positions (0 before the cache is allocated)."""
    layer = dec.cache.layers[0] if dec.cache is not None and dec.cache.layers else None
    keys = getattr(layer, "keys", None)
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
        return 0
    B, H, _, D = keys.shape
    return 2 * B * H * int(length) * D * keys.element_size()


@contextlib.contextmanager
def instrument(dec: StaticDecoder, kv_len: int):
    """Ranges around every module call and glue op of ``dec``'s decode step while inside (a
    :class:`StepRecorder`); hooks and patches removed on exit."""
    rec = StepRecorder(kv_layer_bytes(dec, kv_len))
    names = _names(dec)
    handles = _hook_modules(rec, dec, names)
    try:
        with contextlib.ExitStack() as stack:
            _glue_patches(rec, dec, names, stack)
            yield rec
    finally:
        for h in handles:
            h.remove()


def _export(prof) -> list[dict]:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return trace_events(json.load(f))
    finally:
        os.unlink(path)


def _span_ms(kernels) -> float:
    return (max(k.end_us for k in kernels) - kernels[0].start_us) / 1e3 if kernels else 0.0


#: profiler runs in this process: the head launches of each run grow with it (see _head)
_RUNS = [0]
HEAD_LAUNCHES = 8  # launches opening a profiler run, besides one per earlier run


def _head(device) -> None:
    """Tiny launches that open a profiler run. Kineto registers CUPTI's timestamp callback again in every
    run, and the k-th run of a process returns its first k kernel records with wrong timestamps
    (pytorch/pytorch#192021): these records are the ones thrown away."""
    x = torch.zeros(1, device=device)
    for _ in range(HEAD_LAUNCHES + _RUNS[0]):
        x.add_(1)
    _RUNS[0] += 1


def _profile_run(dec: StaticDecoder, ctx: int, reset, graph: bool):
    """One profiler run: head launches, one graph replay (``graph``), then the instrumented eager step, each in
    a range of its own. Returns (step ranges, eager kernels, replay kernels or None)."""
    cuda = dec.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), instrument(dec, ctx + 1) as rec:
        with profile(activities=acts) as prof:
            with rec.range("head", "other"):
                _head(dec.device)
                sync()
            if graph:
                with rec.range("replay", "other") as replay:
                    dec.step()
                    sync()
                with rec.range("reset", "other"):
                    reset()
            with rec.range("step", "other") as step:
                dec._step_body()
                sync()
        ranges = rec.finish()
    eager, replayed = split_run(drop_far(attribute(_export(prof))), ranges, step.id, replay.id if graph else None)
    return {i: ranges[i] for i in subtree(ranges, step.id)}, eager, replayed


def profile_decoder(dec: StaticDecoder, ctx: int, *, ceiling_tbps: float, step_ms: float | None = None,
                    meta: dict | None = None, graph: bool = True) -> StepProfile:
    """One decode step of ``dec`` at cache length ``ctx`` (after a prefill of at least ``ctx`` tokens), profiled as
    the module doc says, in one profiler run; the decoder is left rewound to ``ctx`` with its token and offset
    as before. ``step_ms``: the unprofiled step time the roofline % is taken against (default: the profiled span).
    ``graph=False``: the eager step's timeline even where the decoder has a CUDA graph."""
    cuda = dec.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ids0, off0 = dec.ids.clone(), dec.offset.clone()

    def reset():
        dec.rewind(ctx)
        dec.ids.copy_(ids0)
        dec.offset.copy_(off0)
        sync()

    graph = bool(graph and dec.graph and cuda)
    with torch.no_grad():
        reset()
        dec._step_body()  # compiled, planned and cached before the profiled step
        reset()
        if graph:
            dec.step()  # captures the graph if not yet done; a warm replay
            reset()
    ranges, eager, replayed = _profile_run(dec, ctx, reset, graph)
    reset()
    info = dict(meta or {})
    info.update(eager_kernels=len(eager), eager_span_ms=_span_ms(eager))
    timeline = eager
    info["timeline"] = "an eager step under torch.profiler (its gaps include host launch time)"
    if replayed:
        timeline, matched = transfer(eager, replayed)
        info["timeline"] = (f"one CUDA-graph replay under torch.profiler, its kernels named by order from an "
                            f"eager step ({matched} of {len(replayed)} matched; eager step: {len(eager)})")
        info["matched"] = matched
    elif graph:
        info["timeline"] += "; the graph replay's trace held no kernels"
    info.setdefault("step_source", "unprofiled step" if step_ms else "profiled span")
    return build_profile(timeline, ranges, ceiling_tbps=ceiling_tbps, step_ms=step_ms, meta=info)
