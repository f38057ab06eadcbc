"""Decoder glue ops (kbit.ops.glue): Triton kernels (the interpreter on the CPU) against float64 references."""
import pytest
import torch

from kbit.ops import glue

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R,H", [(1, 64), (3, 100), (2, 4096)])
def test_add_rms_norm(dtype, R, H):
    g = torch.Generator().manual_seed(R * H)
    x = torch.randn(R, H, generator=g).to(dtype).to(DEV)
    res = torch.randn(R, H, generator=g).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(DEV)
    y, r = glue.add_rms_norm(x, res, w, 1e-5)
    y_ref, r_ref = glue.rms_norm_reference(x.double(), w.double(), 1e-5, res.double())
    assert r.dtype == dtype and y.dtype == dtype
    assert torch.equal(r, res + x)  # the residual add rounds as transformers' does
    assert _rel(y, y_ref) < TOL[dtype]
    y1 = glue.rms_norm(x, w, 1e-5)
    assert _rel(y1, glue.rms_norm_reference(x.double(), w.double(), 1e-5)[0]) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("pos_settled", [False, True])
def test_rope_append(dtype, qk_norm, pos_settled):
    g = torch.Generator().manual_seed(7 + qk_norm)
    B, Hq, Hkv, D, L, p = 2, 4, 2, 16, 8, 5
    fused = torch.randn(B, (Hq + 2 * Hkv) * D + 3, generator=g).to(dtype).to(DEV)  # 3 spare columns
    q, k, v = fused[:, :Hq * D], fused[:, Hq * D:(Hq + Hkv) * D], fused[:, (Hq + Hkv) * D:(Hq + 2 * Hkv) * D]
    ang = torch.arange(L).double()[:, None] * torch.rand(D // 2, generator=g).double()[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype).to(DEV)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype).to(DEV)
    kc = torch.randn(B, Hkv, L, D, generator=g).to(dtype).to(DEV)  # poison: other positions must stay
    vc = torch.randn(B, Hkv, L, D, generator=g).to(dtype).to(DEV)
    kc0, vc0 = kc.clone(), vc.clone()
    qn = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEV) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEV) if qk_norm else None
    pos = torch.tensor([p], device=DEV)
    q_out = glue.rope_append(q, k, v, cos, sin, pos, kc, vc, qn, kn, 1e-6, pos_settled=pos_settled)
    kr, vr = kc0.double().clone(), vc0.double().clone()
    q_ref = glue.rope_append_reference(q.double(), k.double(), v.double(), cos.double(), sin.double(), pos, kr, vr,
                                       None if qn is None else qn.double(), None if kn is None else kn.double(), 1e-6)
    assert q_out.shape == (B, Hq, D)
    assert _rel(q_out, q_ref) < TOL[dtype]
    other = torch.arange(L, device=DEV) != p
    assert torch.equal(kc[:, :, other], kc0[:, :, other]) and torch.equal(vc[:, :, other], vc0[:, :, other])
    assert _rel(kc[:, :, p], kr[:, :, p]) < TOL[dtype]
    assert torch.equal(vc[:, :, p], v.reshape(B, Hkv, D))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(3, 2 * 1500, generator=g).to(dtype).to(DEV)
    gate, up = gu[:, :1500], gu[:, 1500:]
    y = glue.silu_mul(gate, up)
    assert _rel(y, glue.silu_mul_reference(gate.double(), up.double())) < TOL[dtype]


def test_glue_validation():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        glue.rms_norm(x, torch.ones(7, device=DEV), 1e-5)
    with pytest.raises(TypeError, match="residual"):
        glue.add_rms_norm(x, x.half(), torch.ones(8, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        glue.rms_norm(torch.randn(8, 2, device=DEV).t(), torch.ones(8, device=DEV), 1e-5)
    with pytest.raises(ValueError, match="up"):
        glue.silu_mul(x, torch.randn(2, 9, device=DEV))
    kc = torch.zeros(2, 1, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="pos"):
        glue.rope_append(x, x, x, torch.ones(4, 8, device=DEV), torch.ones(4, 8, device=DEV), 1, kc, kc.clone())
    with pytest.raises(ValueError, match="head dim"):
        kc6 = torch.zeros(2, 1, 4, 6, device=DEV)
        glue.rope_append(x[:, :6], x[:, :6], x[:, :6], torch.ones(4, 6, device=DEV), torch.ones(4, 6, device=DEV),
                         torch.tensor([0], device=DEV), kc6, kc6.clone())
    with pytest.raises(TypeError, match="pos_settled"):
        glue.rope_append(x, x, x, torch.ones(4, 8, device=DEV), torch.ones(4, 8, device=DEV),
                         torch.tensor([0], device=DEV), kc, kc.clone(), pos_settled=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [1, 100, 4096, 9000])
def test_argmax(dtype, V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(3, V, generator=g).to(dtype).to(DEV)
    if V > 50:
        x[1, 7] = x[1, V - 3] = x[1].max() + 1  # a tie: the first index wins
        x[2, V // 2] = float("nan")  # NaN wins, as in torch
    got = glue.argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), x.float().cpu().argmax(-1))
