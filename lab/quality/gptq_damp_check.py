"""GPTQ damping and calibration size on one SmolLM2 decoder layer, judged on held-out text (docs/quality.md): the
output error relative to RTN (k = 3) of v_proj, up_proj, down_proj for 4k/16k/32k calibration tokens and damp
0.01/0.1/1, without and with the rotation.

    PYTHONPATH=src python lab/quality/gptq_damp_check.py 5      # the layer index
"""

import sys
from pathlib import Path

import torch

from kbit.calibrate import RandomHadamard, decoder_layers, gptq_quantize
from kbit.eval.judges import lee_text
from kbit.eval.methods import fake_quant
from kbit.format.reference import dequantize_reference

sys.path.insert(0, str(Path(__file__).parent))
from rotation_gptq_study import load  # noqa: E402

torch.set_num_threads(1)
model, tok = load("smollm2")
ids = tok(lee_text(), return_tensors="pt").input_ids[0]
calib = [ids[16000 + i * 512:16000 + (i + 1) * 512][None] for i in range(64)]
held = [ids[i * 512:(i + 1) * 512][None] for i in range(4)]
layer = decoder_layers(model)[1][int(sys.argv[1])]
names = ["self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"]
mods = dict(layer.named_modules())
xs = {n: [] for n in names}
hooks = [mods[n].register_forward_pre_hook(lambda _m, a, n=n: xs[n].append(a[0].reshape(-1, a[0].shape[-1])))
         for n in names]
with torch.no_grad():
    for b in calib + held:
        model.model(b, use_cache=False)
for h in hooks:
    h.remove()
for n in names:
    Xh = torch.cat(xs[n][-4:]).double()
    W = mods[n].weight.data
    rot = RandomHadamard(W.shape[1])

    def err(W_hat, W=W, Xh=Xh):
        return float(((Xh @ (W.double() - W_hat.double()).T) ** 2).sum() / ((Xh @ W.double().T) ** 2).sum())

    rtn = err(fake_quant(W, 3))
    out = []
    for nb in (8, 32, 64):
        Xc = torch.cat(xs[n][:nb]).double()
        H = (Xc.T @ Xc).float()
        for damp in (0.01, 0.1, 1.0):
            g = dequantize_reference(gptq_quantize(W, H, k=3, damp=damp))
            qr = gptq_quantize(rot.rotate(W.double()).float(), rot.rotate_hessian(H.double()), k=3, damp=damp)
            gr = rot.unrotate(dequantize_reference(qr).double())
            out.append((nb * 512, damp, round(err(g) / rtn, 3), round(err(gr) / rtn, 3)))
    print(n, "rtn", round(rtn, 5), out, flush=True)
