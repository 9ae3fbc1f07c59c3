"""The book's tools: the "you are here" engine maps."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import engine_map  # noqa: E402

TOC = (ROOT / "_toc.yml").read_text(encoding="utf-8")


@pytest.mark.parametrize("chapter", sorted(engine_map.TITLES))
def test_engine_map_is_committed_and_up_to_date(chapter):
    path = engine_map.path(chapter)
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: run `make figures`"
    assert path.read_text(encoding="utf-8") == engine_map.svg(chapter), \
        f"{path.relative_to(ROOT)} differs from what tools/engine_map.py draws: run `make figures`"


@pytest.mark.parametrize("chapter", sorted(engine_map.TITLES))
def test_engine_map_text_stays_inside_its_boxes(chapter):
    fig = engine_map.draw(chapter)
    try:
        assert engine_map.overflow(fig) == []
    finally:
        engine_map.plt.close(fig)


def test_engine_map_highlights_what_each_chapter_builds():
    for chapter in range(1, 8):
        assert engine_map.HIGHLIGHT[chapter], f"chapter {chapter} highlights nothing"
    assert engine_map.HIGHLIGHT[3] == {"kv"}
    assert "Chapter 3: The KV cache" in engine_map.svg(3)  # the SVG's title names it


def test_engine_map_rejects_an_unknown_chapter():
    with pytest.raises(ValueError, match="chapter must be one of"):
        engine_map.draw(max(engine_map.TITLES) + 1)


def test_overflow_check_can_fail():
    fig = engine_map.draw(1)
    try:
        label = next(t for t in fig.axes[0].texts if t.get_gid() == "label-sampling")
        label.set_fontsize(30)  # far too big for its box, still inside the figure
        assert any("overflows box 'sampling'" in p for p in engine_map.overflow(fig))
    finally:
        engine_map.plt.close(fig)


def test_every_chapter_in_the_toc_has_a_map():
    for line in TOC.splitlines():
        if "file: chapters/" in line:
            n = int(line.split("chapters/")[1][:2])
            assert engine_map.path(n).exists(), f"no engine map for chapter {n}"
