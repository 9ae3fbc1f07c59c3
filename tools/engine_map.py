"""Draw the "you are here" map of the engine that opens every chapter.

    python tools/engine_map.py            # write book/figures/engine_map_00.svg ... _13.svg
    python tools/engine_map.py --check    # fail if a committed map differs from a fresh one

One drawing of the engine's data flow (text -> tokenizer -> prompt ids -> scheduler ->
model with its KV cache -> sampling -> text, and the memory parts below it). Each map
highlights the parts that chapter N builds and names the chapter in a banner on top.
The output is deterministic (fixed SVG ids, no date), so the committed files can be
compared with a fresh drawing.
"""
from __future__ import annotations

import argparse
import io
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "book" / "figures"

TITLES = {
    0: "What an inference engine does",
    1: "The tokenizer",
    2: "The model and the naive loop",
    3: "The KV cache",
    4: "Continuous batching",
    5: "INT8",
    6: "PagedAttention",
    7: "Performance",
    8: "Troubleshooting",
    9: "Serving",
    10: "Speculative decoding",
    11: "Structured output",
    12: "Batch invariance",
    13: "Tensor parallelism",
}

WIDTH, HEIGHT = 10.0, 5.45  # data units: the layout below is written in them
SCALE = 0.72  # inches per data unit: the map is 7.2 inches wide, the column's width,
# so the website shows it at its own size and a 9-point label reads as 12 px
FONT = 9  # points
TAG = FONT - 1.5  # the small print: "ch N" tags, the loop's labels, the legend

# colours: highlighted (this chapter) and the rest
HI_FILL, HI_EDGE, HI_TEXT = "#ffe2b8", "#d9730d", "#3b2300"
LO_FILL, LO_EDGE, LO_TEXT = "#f3f4f6", "#b8bcc4", "#6b7280"
ARROW = "#8a8f98"
SYMPTOM_FILL, SYMPTOM_EDGE = "#fde2e2", "#c0392b"


@dataclass(frozen=True)
class Box:
    key: str
    x: float
    y: float
    w: float
    h: float
    label: str
    chapter: int  # the chapter that builds it
    title_top: bool = False  # label at the top (container boxes) instead of centred


# Row A (left to right): the request goes in. Row B (right to left): tokens come out.
ROW_A, ROW_B, ROW_H = 3.4, 2.2, 0.9
BOXES = [
    Box("text_in", 0.15, ROW_A, 1.05, ROW_H, "text", 0),
    Box("encode", 1.50, ROW_A, 1.50, ROW_H, "Tokenizer\nencode", 1),
    Box("prompt", 3.30, ROW_A, 1.55, ROW_H, "prompt ids,\nparams", 4),
    Box("scheduler", 5.15, ROW_A, 1.60, ROW_H, "Scheduler\nengine.step()", 4),
    Box("model", 7.10, ROW_B, 2.75, ROW_A + ROW_H - ROW_B, "Model", 2, title_top=True),
    Box("attention", 7.25, ROW_B + 0.3, 1.15, 0.62, "attention", 2),
    Box("kv", 8.60, ROW_B + 0.3, 1.10, 0.62, "KV cache", 3),
    Box("sampling", 5.15, ROW_B, 1.60, ROW_H, "Sampling", 2),
    Box("new_ids", 3.30, ROW_B, 1.55, ROW_H, "new token:\nstop? stream", 4),
    Box("decode", 1.50, ROW_B, 1.50, ROW_H, "Tokenizer\ndecode", 1),
    Box("text_out", 0.15, ROW_B, 1.05, ROW_H, "text", 0),
    # memory row
    Box("memory", 0.15, 0.55, 3.35, 0.95, "GPU memory budget:\nweights + KV cache (GiB)", 0),
    Box("perf", 3.80, 0.55, 2.95, 0.95, "Fast decode steps:\nCUDA graphs, profiler", 7),
    Box("int8", 7.10, 0.55, 1.30, 0.95, "INT8\nweights", 5),
    Box("paged", 8.60, 0.55, 1.25, 0.95, "Paged KV\nblocks", 6),
]
BY_KEY = {b.key: b for b in BOXES}

# The overview chapter shows the whole pipeline; the others build their own boxes.
HIGHLIGHT = {n: {b.key for b in BOXES if b.chapter == n} for n in TITLES}
HIGHLIGHT[0] = {"text_in", "encode", "prompt", "scheduler", "model", "attention", "kv",
                "sampling", "new_ids", "decode", "text_out", "memory"}
HIGHLIGHT[8] = set()
HIGHLIGHT[9] = {"text_in", "text_out"}  # and the server box drawn below them
HIGHLIGHT[10] = set()  # its parts are drawn below the loop
HIGHLIGHT[11] = set()  # the mask is drawn below the sampling box
HIGHLIGHT[12] = set()  # the fixed-order model is drawn below it
HIGHLIGHT[13] = set()  # the model's ranks are drawn below it

# Chapters 10-13 draw their part as a band below the loop: (width, text, gid, arrow to)
BANDS = {
    10: (6.60, "draft k tokens → verify in one forward → rejection sampler", "proposer",
         (7.6, ROW_B)),  # drafts from a proposer, verified by the model
    11: (5.20, "grammar → matcher → token bitmask (−∞)", "mask",
         (5.95, ROW_B)),  # a grammar's mask on the logits, before sampling
    12: (6.60, "linears in fixed row blocks, attention page by page", "invariant",
         (7.6, ROW_B)),  # the model's sums in a fixed order, whatever the batch
    13: (6.60, "the model split over N processes: heads, MLP, vocabulary", "ranks",
         (7.6, ROW_B)),  # every layer's weights split over the ranks
}

# Chapter 8 marks where each symptom of its troubleshooting table comes from.
SYMPTOMS = [  # (text, x, y) of the tag's centre
    ("garbled text", 2.25, ROW_B - 0.22),
    ("early stop", 4.075, ROW_B - 0.22),
    ("repetition", 5.95, ROW_B - 0.22),
    ("slow first token", 8.475, ROW_A - 0.12),
    ("slow decoding", 8.6, ROW_A + ROW_H + 0.3),
    ("out of memory", 1.825, 1.5),
]

ARROWS = [  # (from, side, to, side)
    ("text_in", "E", "encode", "W"),
    ("encode", "E", "prompt", "W"),
    ("prompt", "E", "scheduler", "W"),
    ("scheduler", "E", "model", "W@A"),
    ("model", "W@B", "sampling", "E"),
    ("sampling", "W", "new_ids", "E"),
    ("new_ids", "W", "decode", "E"),
    ("decode", "W", "text_out", "E"),
    ("sampling", "N", "scheduler", "S"),
    ("int8", "N", "attention", "S"),
    ("paged", "N", "kv", "S"),
    ("attention", "E", "kv", "W"),
]


def anchor(box: Box, side: str) -> tuple[float, float]:
    side, _, row = side.partition("@")
    cy = {"A": ROW_A + ROW_H / 2, "B": ROW_B + ROW_H / 2}.get(row, box.y + box.h / 2)
    return {
        "E": (box.x + box.w, cy),
        "W": (box.x, cy),
        "N": (box.x + box.w / 2, box.y + box.h),
        "S": (box.x + box.w / 2, box.y),
    }[side]


def draw(chapter: int) -> plt.Figure:
    if chapter not in TITLES:
        raise ValueError(f"chapter must be one of {sorted(TITLES)}, got {chapter!r}")
    plt.rcParams["svg.hashsalt"] = "minillm-engine-map"
    plt.rcParams["font.family"] = "DejaVu Sans"
    fig = plt.figure(figsize=(WIDTH * SCALE, HEIGHT * SCALE))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH)
    ax.set_ylim(0, HEIGHT)
    ax.set_axis_off()
    hi = HIGHLIGHT[chapter]

    # decode loop frame
    ax.add_patch(FancyBboxPatch((5.0, ROW_B - 0.4), 4.95, ROW_A + ROW_H - ROW_B + 0.52,
                                boxstyle="round,pad=0,rounding_size=0.12", fill=False,
                                ls=(0, (4, 3)), lw=1.0, ec=LO_EDGE, gid="decode-loop"))
    ax.text(5.1, ROW_A + ROW_H + 0.17, "decode loop: once per new token", fontsize=TAG,
            color=LO_TEXT, va="bottom", ha="left", style="italic")

    for b in BOXES:
        on = b.key in hi
        container = b.key == "model"
        ax.add_patch(FancyBboxPatch(
            (b.x, b.y), b.w, b.h, boxstyle="round,pad=0,rounding_size=0.1",
            fc=(HI_FILL if on else LO_FILL) if not container else ("#fff4e5" if on else "white"),
            ec=HI_EDGE if on else LO_EDGE, lw=2.2 if on else 1.0, gid=f"box-{b.key}",
            zorder=1 if container else 2))
        ty = b.y + b.h - 0.2 if b.title_top else b.y + b.h / 2
        ax.text(b.x + b.w / 2, ty, b.label, ha="center", va="center", fontsize=FONT,
                color=HI_TEXT if on else LO_TEXT, fontweight="bold" if on else "normal",
                linespacing=1.15, zorder=3, gid=f"label-{b.key}")
        if b.key not in ("text_in", "text_out"):
            ax.text(b.x + b.w - 0.06, b.y + 0.05, f"ch {b.chapter}", ha="right", va="bottom",
                    fontsize=TAG, color=HI_EDGE if on else LO_EDGE, zorder=3,
                    gid=f"tag-{b.key}")
    ax.text(BY_KEY["model"].x + BY_KEY["model"].w / 2, ROW_A + 0.25,
            "embed → N × layer → LM head", ha="center", va="center", fontsize=FONT - 1,
            color=HI_TEXT if "model" in hi else LO_TEXT, zorder=3, gid="label-model-flow")

    for src, s_side, dst, d_side in ARROWS:
        start, end = anchor(BY_KEY[src], s_side), anchor(BY_KEY[dst], d_side)
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=13,
                                     lw=1.3, color=ARROW, shrinkA=1, shrinkB=1, zorder=4))
    # the loop arrow's label: a new token goes back to the scheduler
    ax.text(5.95 + 0.08, (ROW_B + ROW_H + ROW_A) / 2, "next step", ha="left", va="center",
            fontsize=TAG, color=LO_TEXT, style="italic")

    if chapter == 8:
        for text, x, y in SYMPTOMS:
            ax.text(x, y, text, ha="center", va="center", fontsize=FONT - 1, zorder=5,
                    color=SYMPTOM_EDGE, fontweight="bold", gid="symptom",
                    bbox=dict(boxstyle="round,pad=0.25", fc=SYMPTOM_FILL, ec=SYMPTOM_EDGE,
                              lw=1.2))

    if chapter == 9:  # the HTTP server in front of the engine: text in, SSE out
        ax.add_patch(FancyBboxPatch((0.15, 1.58), 2.85, 0.45,
                                    boxstyle="round,pad=0,rounding_size=0.1", fc=HI_FILL,
                                    ec=HI_EDGE, lw=2.2, gid="box-serve", zorder=2))
        ax.text(1.575, 1.805, "OpenAI API server: HTTP, SSE", ha="center", va="center",
                fontsize=FONT, color=HI_TEXT, fontweight="bold", zorder=3, gid="serve")
        ax.add_patch(FancyArrowPatch((0.675, 2.03), (0.675, ROW_B), arrowstyle="<|-|>",
                                     mutation_scale=13, lw=1.3, color=ARROW, zorder=4))

    if chapter in BANDS:  # a band below the loop, with an arrow to what it acts on
        width, text, gid, (x_to, y_to) = BANDS[chapter]
        ax.add_patch(FancyBboxPatch((0.15, 1.58), width, 0.45,
                                    boxstyle="round,pad=0,rounding_size=0.1", fc=HI_FILL,
                                    ec=HI_EDGE, lw=2.2, gid=f"box-{gid}", zorder=2))
        ax.text(0.15 + width / 2, 1.805, text, ha="center", va="center",
                fontsize=FONT, color=HI_TEXT, fontweight="bold", zorder=3, gid=gid)
        ax.add_patch(FancyArrowPatch((0.15 + width, 1.805), (x_to, y_to), arrowstyle="-|>",
                                     mutation_scale=13, lw=1.3, color=ARROW, zorder=4,
                                     connectionstyle="arc3,rad=0.25"))

    # banner: where this chapter sits
    ax.add_patch(FancyBboxPatch((0.15, 4.75), 9.7, 0.55, boxstyle="round,pad=0,rounding_size=0.1",
                                fc=HI_FILL, ec=HI_EDGE, lw=1.5))
    ax.text(0.35, 5.025, f"You are here → Chapter {chapter}: {TITLES[chapter]}",
            ha="left", va="center", fontsize=FONT + 3, color=HI_TEXT, fontweight="bold",
            gid="banner")
    legend = ("highlighted: built in this chapter" if chapter not in (0, 8) else
              "highlighted: the parts this chapter walks through" if chapter == 0 else
              "red tags: where each symptom starts")
    ax.text(9.7, 0.2, legend + "   ·   ch N: the chapter that builds a part", ha="right",
            va="center", fontsize=TAG, color=LO_TEXT)
    return fig


def overflow(fig: plt.Figure) -> list[str]:
    """Texts whose drawn extent leaves the figure or the box they label."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    fig_box = fig.bbox
    problems = []
    for t in ax.texts:
        ext = t.get_window_extent(renderer)
        if t.get_bbox_patch() is not None:
            ext = t.get_bbox_patch().get_window_extent(renderer)
        if not (ext.x0 >= fig_box.x0 and ext.x1 <= fig_box.x1 and ext.y0 >= fig_box.y0
                and ext.y1 <= fig_box.y1):
            problems.append(f"{t.get_text()!r} leaves the figure")
        gid = t.get_gid() or ""
        if gid.startswith(("label-", "tag-")):
            key = gid.split("-", 1)[1].removesuffix("-flow")
            b = BY_KEY[key]
            box = ax.transData.transform([(b.x, b.y), (b.x + b.w, b.y + b.h)])
            pad = 2  # pixels of room between a label and its box's edge
            if not (ext.x0 >= box[0][0] + pad and ext.x1 <= box[1][0] - pad
                    and ext.y0 >= box[0][1] + pad and ext.y1 <= box[1][1] - pad):
                problems.append(f"{t.get_text()!r} overflows box {key!r}")
    # no two texts overlap (a tag under a two-line label, a symptom on a label, ...)
    exts = []
    for t in ax.texts:
        patch = t.get_bbox_patch()
        exts.append((t.get_text(), (patch or t).get_window_extent(renderer)))
    for i, (a, ea) in enumerate(exts):
        for b, eb in exts[i + 1:]:
            if ea.overlaps(eb):
                problems.append(f"{a!r} overlaps {b!r}")
    return problems


def svg(chapter: int) -> str:
    fig = draw(chapter)
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None,
                                             "Title": f"Chapter {chapter}: {TITLES[chapter]}"})
    plt.close(fig)
    return buf.getvalue()


def path(chapter: int) -> Path:
    return OUT / f"engine_map_{chapter:02d}.svg"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--png", action="store_true", help="also write PNG previews to _build/")
    args = parser.parse_args()
    bad = []
    for n in TITLES:
        fig = draw(n)
        bad += [f"chapter {n}: {p}" for p in overflow(fig)]
        if args.png:
            (ROOT / "_build").mkdir(exist_ok=True)
            fig.savefig(ROOT / "_build" / f"engine_map_{n:02d}.png", dpi=80)
        plt.close(fig)
        text = svg(n)
        if args.check:
            if not path(n).exists() or path(n).read_text(encoding="utf-8") != text:
                bad.append(f"{path(n).relative_to(ROOT)} is out of date: run `make figures`")
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path(n).write_text(text, encoding="utf-8")
            print(f"wrote {path(n).relative_to(ROOT)}")
    if bad:
        print("\n".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
