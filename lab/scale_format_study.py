"""Which block/scale configuration is more accurate at equal bits? (docs/quality.md)

SQNR (dB) of kbit.quantize on N(0, 1) and Student-t(5) weights (2048 x 4096, fixed seed) for every k and
named codebook, comparing blocksize 32 with 8-bit log scales against blocksize 64 with fp16 scales (both
k + 0.25 bits per weight), plus the k + 0.125 configurations. Prints a markdown table.

    python lab/scale_format_study.py > docs/quality-scales.md
"""

import torch

import kbit
from kbit.format.codebooks import sqnr_db

CONFIGS = [(32, "log8"), (64, "fp16"), (64, "log8"), (128, "fp16")]


def weights():
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(2048, 4096, generator=g)
    z = torch.randn(2048, 4096, generator=g)
    chi2 = (torch.randn(2048, 4096, 5, generator=g) ** 2).sum(-1)
    return {"N(0,1)": gauss, "t(5)": z / torch.sqrt(chi2 / 5)}


def main():
    head = " | ".join(f"B={b} {f} (k+{(8 if f == 'log8' else 16) / b:.3f})" for b, f in CONFIGS)
    print(f"| weights | k | codebook | {head} |")
    print("|---|---|---|" + "---|" * len(CONFIGS))
    for wname, W in weights().items():
        for k in (2, 3, 4, 5):
            for cb in ("nf", "nf0", "uniform", "lloyd", "lloyd0", "fit"):
                cells = []
                for b, f in CONFIGS:
                    qw = kbit.quantize(W, k=k, blocksize=b, codebook=cb, scale_format=f)
                    cells.append(f"{sqnr_db(W, kbit.dequantize(qw, torch.float32)):.2f}")
                print(f"| {wname} | {k} | {cb} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
