"""The demo's figure: each exported tier's test accuracy, with its binomial standard error, and
its onnxruntime latency, against its MACs.

Usage: python tools/demo_figure.py EXPORT_DIR [--out FILE]   (default: EXPORT_DIR/tiers.png)

Reads only the export's manifest: each FP32 tier's accuracy as measured at export, on how many
test images (its ``accuracy_on``; else ``--test-images``), and its median latency on the
exporting machine. Prints one line per tier and one line saying which neighbouring tiers differ
by less than the standard error of their difference (a tie on this test split, not an ordering).
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path


def standard_error(accuracy: float, images: int) -> float:
    """The binomial standard error of an accuracy measured on ``images`` test images."""
    return math.sqrt(accuracy * (1 - accuracy) / images)


def images_measured(accuracy_on: str | None) -> int | None:
    """The number of test images in an entry's ``accuracy_on`` ("digits test split (450 images)")."""
    found = re.search(r"\(([\d,]+) images\)", accuracy_on or "")
    return int(found.group(1).replace(",", "")) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="an export directory (nefl-zoo export RUN --out DIR)")
    parser.add_argument("--out", type=Path, help="the figure (PNG or SVG; default EXPORT/tiers.png)")
    parser.add_argument("--test-images", type=int, help="test images the accuracies were measured on")
    args = parser.parse_args()

    from nefl_zoo.manifest import load_manifest

    manifest = load_manifest(args.export / "manifest.json")
    tiers = sorted((t for t in manifest.tiers if t.precision == "fp32" and t.accuracy is not None), key=lambda t: t.macs)
    if not tiers:
        raise SystemExit(f"{args.export}: no FP32 tier with a measured accuracy")
    images = args.test_images or images_measured(tiers[0].accuracy_on)
    if images is None:
        raise SystemExit(f"{args.export}: the manifest does not say how many test images; pass --test-images N")
    errors = [standard_error(t.accuracy, images) for t in tiers]
    for t, se in zip(tiers, errors):
        print(f"{t.name:>8}: {t.macs / 1e6:7.2f}M MACs  accuracy {100 * t.accuracy:5.1f}% +- {100 * se:.1f}  "
              f"latency {t.latency.median_ms:.3f} ms")
    ties = [f"{a.name} and {b.name}" for (a, ea), (b, eb) in zip(zip(tiers, errors), zip(tiers[1:], errors[1:]))
            if abs(b.accuracy - a.accuracy) <= math.hypot(ea, eb)]
    print(f"one standard error on {images} test images: {100 * min(errors):.1f} to {100 * max(errors):.1f} points; "
          + (f"{', '.join(ties)} differ by less than their difference's standard error (a tie, not an ordering)"
             if ties else "each tier is more accurate than the one below it by more than that"))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    macs = [t.macs / 1e6 for t in tiers]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6), constrained_layout=True)
    left.errorbar(macs, [100 * t.accuracy for t in tiers], yerr=[100 * e for e in errors], marker="o", capsize=3)
    left.set(xlabel="MACs (millions)", ylabel="test accuracy (%)", title=f"accuracy, +- 1 s.e. ({images} images)")
    right.plot(macs, [t.latency.median_ms for t in tiers], marker="o")
    right.set(xlabel="MACs (millions)", ylabel="median latency (ms)", title=f"onnxruntime latency, batch {tiers[0].latency.batch}")
    for t, x in zip(tiers, macs):
        left.annotate(t.name, (x, 100 * t.accuracy), textcoords="offset points", xytext=(4, -10), fontsize=8)
        right.annotate(t.name, (x, t.latency.median_ms), textcoords="offset points", xytext=(4, -10), fontsize=8)
    fig.suptitle(f"{manifest.model}: every tier of one nested model")
    out = args.out or args.export / "tiers.png"
    fig.savefig(out, dpi=120)
    print(f"figure: {out}")


if __name__ == "__main__":
    main()
