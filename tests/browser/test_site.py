"""The website as a reader meets it, checked in headless Chromium (`make site`, then
`make browser`): every page of the built site is opened and checked for broken internal
links, images that do not load, content wider than the page's column, raw error output,
JavaScript errors, figures shown smaller than they were drawn, machine paths and object
reprs in outputs, text tables that do not fit their box, the Colab launch button on every
chapter, and chapter 0's memory calculator against the cases its notebook computed with the
Python function."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("MINILLM_SITE", ROOT / "_build" / "html"))  # as in conftest.py
sys.path.insert(0, str(ROOT / "tools"))
from setup_cell import repository_url  # noqa: E402

pytestmark = pytest.mark.browser

SKIP_DIRS = {"_static", "_sources", "_images", "_sphinx_design_static", "_panels_static"}
PAGES = sorted(str(p.relative_to(SITE)) for p in SITE.rglob("*.html")
               if not SKIP_DIRS & set(p.relative_to(SITE).parts)) or ["index.html"]
CHAPTERS = sorted(p.stem for p in (ROOT / "chapters").glob("*.ipynb"))
REFRESH = re.compile(r'<meta[^>]+http-equiv="refresh"[^>]+content="\d+;\s*url=([^"]+)"', re.I)
ERROR_SELECTOR = (".output.stderr, .output.traceback, .output.error, .system-message, "
                  ".problematic, .cell_output .stderr")
# A figure drawn at the column's width (about 7 inches at 100 dpi) is shown at its own
# size; one drawn 12 inches wide is shrunk to about half, and its 10-point labels with it.
MIN_FIGURE_SCALE = 0.8
# What an output must not show: a path of the machine that built the site, or the repr
# of a Python object (its memory address): noise to a reader, different on every build.
MACHINE_TEXT = r"(?:/(?:tmp|work|home|root)/|site-packages|<[^<>\n]{1,120} at 0x[0-9a-fA-F]+>)"
# The longest line a printed output may have: a longer one wraps on the page (and in
# Jupyter) in the middle of a token list or a message, where the reader loses the thread.
MAX_OUTPUT_LINE = 120

# One pass over a loaded page collects everything the tests below look at.
COLLECT = """
async () => {
  for (const d of document.querySelectorAll('details')) d.open = true;  // hidden solutions
  const imgs = [...document.images];
  imgs.forEach(i => { i.loading = 'eager'; });
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => {
    i.addEventListener('load', r); i.addEventListener('error', r); setTimeout(r, 10000);
  })));
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  const describe = el => {
    const cls = (el.getAttribute('class') || '').trim().split(/\\s+/).slice(0, 3).join('.');
    const txt = (el.innerText || el.textContent || '').trim().replace(/\\s+/g, ' ');
    return `<${el.tagName.toLowerCase()}${cls ? '.' + cls : ''}> ${txt.slice(0, 70)}`;
  };
  const article = document.querySelector('article.bd-article') ||
                  document.querySelector('main') || document.body;
  const col = article.getBoundingClientRect();
  const inside = r => r.left >= col.left - 1 && r.right <= col.right + 1;
  const scrolls = ['auto', 'scroll'];  // 'hidden' or 'clip' would cut the content off
  const scrolledInside = el => {
    for (let p = el.parentElement; p && p !== article; p = p.parentElement) {
      if (scrolls.includes(getComputedStyle(p).overflowX) &&
          inside(p.getBoundingClientRect())) return true;
    }
    return false;
  };
  const overflow = [];
  const reported = [];
  const report = (el, why) => {
    if (reported.some(p => p.contains(el))) return;  // its ancestor is reported already
    reported.push(el);
    overflow.push(`${describe(el)} (${why}; column ${Math.round(col.left)}-` +
                  `${Math.round(col.right)} px)`);
  };
  for (const el of article.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width <= 1 || r.height <= 1) continue;  // hidden, or screen-reader-only text
    const style = getComputedStyle(el);
    // the element's own box
    if (!inside(r) && !scrolledInside(el)) {
      report(el, `box reaches ${Math.round(r.right)} px`);
      continue;
    }
    // what it holds: wider than its box?
    // (a few pixels are a glyph's overhang, e.g. an italic letter in inline math)
    if (el.scrollWidth <= el.clientWidth + 8 || el.clientWidth === 0) continue;
    if (scrolls.includes(style.overflowX)) continue;  // scrolls inside its own box
    if (style.overflowX === 'hidden' || style.overflowX === 'clip') {
      if (style.textOverflow !== 'ellipsis') {
        report(el, `content ${el.scrollWidth} px wide is cut at ${el.clientWidth} px`);
      }
    } else if (r.left + el.scrollWidth > col.right + 1 && !scrolledInside(el)) {
      report(el, `content runs to ${Math.round(r.left + el.scrollWidth)} px`);
    }
  }
  // code blocks, outputs and tables that hold more than their box shows (a reader
  // would have to scroll sideways to see the rest)
  const sideways = [];
  const boxes = article.querySelectorAll(
    'pre, table, div.cell_output, div.output, div.pst-scrollable-table-container');
  for (const el of boxes) {
    const r = el.getBoundingClientRect();
    if (r.width <= 1 || r.height <= 1) continue;
    if (el.scrollWidth > el.clientWidth + 2 &&
        !sideways.some(s => s.el.contains(el) || el.contains(s.el))) {
      sideways.push({el, text: `${describe(el)} (${el.scrollWidth} px of content ` +
                               `in ${el.clientWidth} px)`});
    }
  }
  // figures in outputs shown below MIN_FIGURE_SCALE of the size they were drawn at
  const outputs = [...article.querySelectorAll('div.cell_output')];
  const shrunk = [];
  for (const out of outputs) {
    for (const img of out.querySelectorAll('img')) {
      const r = img.getBoundingClientRect();
      if (!img.naturalWidth || r.width <= 1) continue;  // broken or hidden: other checks
      const scale = r.width / img.naturalWidth;
      if (scale < %(min_scale)s) {
        shrunk.push(`${(img.getAttribute('src') || '').slice(0, 40)}: drawn ` +
                    `${img.naturalWidth} px wide, shown at ${Math.round(r.width)} px ` +
                    `(${scale.toFixed(2)} of its size)`);
      }
    }
  }
  // machine paths and object reprs in the text of outputs
  const machine = new RegExp(%(machine)s, 'g');
  const noise = [];
  for (const out of outputs) {
    const text = out.innerText || out.textContent || '';
    for (const m of text.matchAll(machine)) {
      const around = text.slice(Math.max(0, m.index - 30), m.index + m[0].length + 30);
      noise.push(`${m[0]} in "${around.replace(/\\s+/g, ' ').trim()}"`);
    }
  }
  // printed lines longer than MAX_OUTPUT_LINE characters
  const longLines = [];
  for (const out of outputs) {
    for (const pre of out.querySelectorAll('pre')) {
      for (const line of (pre.textContent || '').split('\\n')) {
        if (line.length > %(max_line)s) {
          longLines.push(`${line.length} characters: ${line.slice(0, 60)}...`);
        }
      }
    }
  }
  // text tables: a plain-text output with rows of three or more columns (fields apart by
  // two or more spaces, or a tab); a row wider than its box wraps (or scrolls), and the
  // columns no longer line up. Widths are measured with the block's own font.
  const canvas = document.createElement('canvas').getContext('2d');
  const wrappedTables = [];
  for (const out of outputs) {
    for (const pre of out.querySelectorAll('pre')) {
      if (pre.closest('table')) continue;
      const r = pre.getBoundingClientRect();
      if (r.width <= 1 || r.height <= 1) continue;
      const style = getComputedStyle(pre);
      const box = pre.clientWidth - parseFloat(style.paddingLeft) -
                  parseFloat(style.paddingRight);
      canvas.font = `${style.fontStyle} ${style.fontWeight} ${style.fontSize} ` +
                    style.fontFamily;
      const rows = (pre.textContent || '').split('\\n')
        .filter(line => line.trim().split(/ {2,}|\\t/).length >= 3);
      if (rows.length < 2) continue;  // one line with wide gaps is not a table
      const wide = rows.filter(line => canvas.measureText(line.replace(/\\t/g, '        '))
                                           .width > box + 1);
      if (wide.length) {
        const widest = Math.max(...wide.map(l => canvas.measureText(l).width));
        wrappedTables.push(`${describe(pre)} (${wide.length} of ${rows.length} table ` +
                           `rows wider than the box: ${Math.round(widest)} px of text ` +
                           `in ${Math.round(box)} px)`);
      }
    }
  }
  // formulas: MathJax replaces each \\( ... \\) with its rendering
  const rawMath = [...article.querySelectorAll('span.math, div.math')]
    .filter(m => /\\\\[(\\[]/.test(m.textContent)).map(describe);
  return {
    shrunk: shrunk.slice(0, 20),
    noise: noise.slice(0, 20),
    wrappedTables: wrappedTables.slice(0, 20),
    longLines: longLines.slice(0, 20),
    widgets: article.querySelectorAll(
      'script[type="application/vnd.jupyter.widget-view+json"]').length,
    rawMath: rawMath.slice(0, 10),
    mathCount: article.querySelectorAll('mjx-container').length,
    sideways: sideways.map(s => s.text).slice(0, 40),
    sidewaysCount: sideways.length,
    title: document.title,
    ids: [...document.querySelectorAll('[id]')].map(e => e.id)
         .concat([...document.querySelectorAll('a[name]')].map(e => e.name)),
    links: [...document.querySelectorAll('a[href]')].map(a => ({
      href: a.href, raw: a.getAttribute('href'), text: (a.innerText || '').trim().slice(0, 40)
    })),
    images: imgs.map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0})),
    pageWidth: document.documentElement.scrollWidth,
    viewport: window.innerWidth,
    overflow: overflow.slice(0, 15),
    errors: [...article.querySelectorAll(%(errors)r)].map(describe).slice(0, 10),
    tracebacks: (article.innerText.match(/Traceback \\(most recent call last\\)/g) || []).length,
  };
}
""" % {"errors": ERROR_SELECTOR, "min_scale": MIN_FIGURE_SCALE,
       "machine": json.dumps(MACHINE_TEXT), "max_line": MAX_OUTPUT_LINE}


class Visits:
    """Opens each page once and keeps what COLLECT found on it."""

    def __init__(self, context, base_url):
        self.context, self.base_url, self.cache = context, base_url, {}

    def __call__(self, rel: str) -> dict:
        if rel not in self.cache:
            html = (SITE / rel).read_text(encoding="utf-8")
            redirect = REFRESH.search(html)
            if redirect:  # e.g. index.html -> book/intro.html: only its target is checked
                href = redirect.group(1)
                self.cache[rel] = {
                    "ids": [], "images": [], "overflow": [], "errors": [], "tracebacks": 0,
                    "sideways": [], "sidewaysCount": 0, "rawMath": [], "mathCount": 0,
                    "widgets": 0, "shrunk": [], "noise": [], "wrappedTables": [], "longLines": [],
                    "js_errors": [], "pageWidth": 0, "viewport": 0,
                    "links": [{"href": urljoin(self.base_url + rel, href), "raw": href,
                               "text": "redirect"}]}
                return self.cache[rel]
            page = self.context.new_page()
            js_errors = []
            page.on("pageerror", lambda e: js_errors.append(str(e)))
            response = page.goto(self.base_url + rel, wait_until="load")
            assert response is not None and response.ok, f"{rel}: HTTP {response and response.status}"
            info = page.evaluate(COLLECT)
            info["js_errors"] = js_errors
            page.close()
            self.cache[rel] = info
        return self.cache[rel]


@pytest.fixture(scope="session")
def visit(context, base_url):
    return Visits(context, base_url)


def site_file(path: str) -> Path:
    """The file in the built site that a URL path names."""
    rel = unquote(path).lstrip("/")
    target = SITE / rel
    return target / "index.html" if (not rel or rel.endswith("/")) else target


@pytest.mark.parametrize("rel", PAGES)
def test_internal_links_resolve(rel, visit, base_url, site):
    host = urlsplit(base_url).netloc
    broken = []
    for link in visit(rel)["links"]:
        raw, parts = link["raw"], urlsplit(link["href"])
        if raw in ("#", "") or parts.scheme not in ("http", "https", "file") \
                or parts.netloc != host:
            continue  # external, mailto:, javascript:, or a bare "#" toggle
        target = site_file(parts.path)
        if not target.is_file():
            broken.append(f"{raw!r} ({link['text']!r}): no file {target.relative_to(site)}")
            continue
        if parts.fragment and target.suffix == ".html":
            target_rel = str(target.relative_to(site))
            ids = visit(target_rel)["ids"] if target_rel in PAGES else \
                re.findall(r'\bid="([^"]+)"', target.read_text(encoding="utf-8"))
            if unquote(parts.fragment) not in ids:
                broken.append(f"{raw!r} ({link['text']!r}): no anchor "
                              f"#{parts.fragment} in {target_rel}")
    assert not broken, f"{rel}: broken internal links:\n" + "\n".join(broken)


@pytest.mark.parametrize("rel", PAGES)
def test_every_image_loads(rel, visit):
    info = visit(rel)
    bad = [img["src"] for img in info["images"] if not img["ok"]]
    assert not bad, f"{rel}: images that do not load: {bad}"


@pytest.mark.parametrize("rel", PAGES)
def test_nothing_is_wider_than_the_page(rel, visit):
    info = visit(rel)
    assert info["pageWidth"] <= info["viewport"], \
        f"{rel}: the page scrolls sideways ({info['pageWidth']} px > {info['viewport']} px)"
    assert not info["overflow"], ("{}: elements run past the content column (they should "
                                  "scroll inside their own box):\n{}".format(
                                      rel, "\n".join(info["overflow"])))


@pytest.mark.parametrize("rel", PAGES)
def test_no_code_block_or_table_scrolls_sideways(rel, visit):
    """At 1280 px the column holds about 80 characters of code: every code block,
    output and table fits it, so nothing hides behind a sideways scroll bar."""
    info = visit(rel)
    assert not info["sideways"], "{}: {} blocks scroll sideways:\n{}".format(
        rel, info["sidewaysCount"], "\n".join(info["sideways"]))


@pytest.mark.parametrize("rel", PAGES)
def test_no_widget_leaves_a_gap(rel, visit):
    """A widget needs a kernel and a renderer from a CDN: on the static site each is a
    blank gap. The staging turns them into text (tools/stage_executed_book.py)."""
    info = visit(rel)
    assert info["widgets"] == 0, f"{rel}: {info['widgets']} widgets, blank on this page"


@pytest.mark.parametrize("rel", PAGES)
def test_formulas_render_offline(rel, visit):
    """MathJax comes from the site itself (the browser reaches nothing else): no
    formula is left as raw TeX."""
    info = visit(rel)
    assert not info["rawMath"], f"{rel}: formulas shown as raw TeX: {info['rawMath']}"


def test_the_book_has_formulas(visit):
    assert sum(visit(f"chapters/{c}.html")["mathCount"] for c in CHAPTERS) > 10


@pytest.mark.parametrize("rel", PAGES)
def test_no_error_output_on_the_page(rel, visit):
    info = visit(rel)
    assert not info["errors"], f"{rel}: error or stderr output shown: {info['errors']}"
    assert info["tracebacks"] == 0, f"{rel}: a traceback is shown on the page"
    assert not info["js_errors"], f"{rel}: JavaScript errors: {info['js_errors']}"


@pytest.mark.parametrize("rel", PAGES)
def test_figures_are_shown_at_the_size_they_were_drawn(rel, visit):
    """A figure drawn wider than the column is shrunk to fit it, and its labels with it:
    drawn 12 inches wide (1,200 px) into a column of about 690 px, a 10-point label is
    about 8 px tall on the page. Figures are drawn at the column's width (about 7 inches),
    so each is shown at 0.8 of its size or more."""
    info = visit(rel)
    assert not info["shrunk"], ("{}: figures shown below {} of the size they were drawn "
                                "at (draw them about 7 inches wide):\n{}".format(
                                    rel, MIN_FIGURE_SCALE, "\n".join(info["shrunk"])))


@pytest.mark.parametrize("rel", PAGES)
def test_no_machine_path_or_object_repr_in_an_output(rel, visit):
    """Outputs show what a reader can use: no path of the machine that built the site
    (/tmp/..., site-packages) and no `<object at 0x...>` repr."""
    info = visit(rel)
    assert not info["noise"], "{}: outputs show machine paths or object reprs:\n{}".format(
        rel, "\n".join(info["noise"]))


@pytest.mark.parametrize("rel", PAGES)
def test_no_output_line_is_longer_than_120_characters(rel, visit):
    """A printed line over MAX_OUTPUT_LINE characters (a token list, a repr, an error
    message) wraps mid-item: print one item per line, fewer items, or wrap the text."""
    info = visit(rel)
    assert not info["longLines"], "{}: output lines over {} characters:\n{}".format(
        rel, MAX_OUTPUT_LINE, "\n".join(info["longLines"]))


@pytest.mark.parametrize("rel", PAGES)
def test_no_text_table_is_wider_than_its_box(rel, visit):
    """A table printed as text wraps (or scrolls) when its rows are wider than the
    column, and its columns no longer line up: show it as a DataFrame (an HTML table)
    or print fewer columns."""
    info = visit(rel)
    assert not info["wrappedTables"], "{}: text tables wider than their box:\n{}".format(
        rel, "\n".join(info["wrappedTables"]))


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_page_has_the_colab_button(chapter, visit):
    rel = f"chapters/{chapter}.html"
    assert rel in PAGES, f"{rel} is not in the built site"
    owner_repo = urlsplit(repository_url()).path.strip("/")
    branch = re.search(r"^repository:\s*\n(?:\s+.*\n)*?\s+branch:\s*(\S+)",
                       (ROOT / "_config.yml").read_text(encoding="utf-8"), re.M).group(1)
    want = (f"https://colab.research.google.com/github/{owner_repo}/blob/{branch}/"
            f"chapters/{chapter}.ipynb")
    hrefs = [link["href"] for link in visit(rel)["links"]]
    assert want in hrefs, (f"{rel}: no Colab launch button to {want}; Colab links found: "
                           f"{[h for h in hrefs if 'colab' in h]}")


def test_every_page_in_the_toc_was_built(site):
    toc = (ROOT / "_toc.yml").read_text(encoding="utf-8")
    for doc in re.findall(r"(?:root|file):\s*(\S+)", toc):
        assert (site / f"{doc}.html").is_file(), f"{doc} is in _toc.yml but not in the site"


# ---- chapter 0: the memory calculator works in the browser ---------------------------

CALCULATOR = "chapters/00_overview.html"
OUTPUTS = ("weights_gib", "kv_gib", "total_gib")


def two_decimals(value) -> str:
    """The cases hold numbers or their text with two decimals; the page shows the text."""
    return value if isinstance(value, str) else f"{value:.2f}"


@pytest.fixture(scope="module")
def calculator_page(context, base_url):
    page = context.new_page()
    js_errors = []
    page.on("pageerror", lambda e: js_errors.append(str(e)))
    page.goto(base_url + CALCULATOR, wait_until="load")
    yield page, js_errors
    page.close()


def test_memory_calculator_matches_the_python_function(calculator_page):
    page, js_errors = calculator_page
    calc = page.locator("div#memory-calculator")
    assert calc.count() == 1, f"{CALCULATOR}: no div#memory-calculator on the page"
    cases = json.loads(page.locator("script#memory-calculator-cases").text_content())
    assert len(cases) >= 2, "memory-calculator-cases holds fewer than two cases"
    presets = calc.locator("select[name=preset] option").evaluate_all(
        "os => os.map(o => o.value)")
    dtypes = calc.locator("select[name=dtype] option").evaluate_all(
        "os => os.map(o => o.value)")
    assert set(presets) <= {c["inputs"]["preset"] for c in cases}, \
        f"the cases do not cover every preset: {presets}"
    assert len({two_decimals(c["expected"]["total_gib"]) for c in cases}) > 1, \
        "every case expects the same total: the test could not see a stuck calculator"
    wrong = []
    for case in cases:
        inputs = case["inputs"]
        assert inputs["dtype"] in dtypes, f"case dtype {inputs['dtype']!r} not in {dtypes}"
        calc.locator("select[name=preset]").select_option(str(inputs["preset"]))
        for name in ("context", "batch"):
            box = calc.locator(f"input[name={name}]")
            box.fill(str(inputs[name]))
            box.dispatch_event("change")
        calc.locator("select[name=dtype]").select_option(str(inputs["dtype"]))
        shown = {k: calc.locator(f"[data-out={k}]").inner_text().strip() for k in OUTPUTS}
        expected = {k: two_decimals(case["expected"][k]) for k in OUTPUTS}
        if shown != expected:
            wrong.append(f"{inputs}: page shows {shown}, Python computed {expected}")
    assert not wrong, "the calculator disagrees with minillm.memory:\n" + "\n".join(wrong)
    assert not js_errors, f"JavaScript errors: {js_errors}"


# ---- the checks themselves can fail ----------------------------------------------------

SYNTHETIC = """<!doctype html><html><head><style>
body {{ margin: 0; }} article.bd-article {{ width: 600px; margin-left: 100px; }}
</style></head><body><article class="bd-article">
<p>Some prose.</p>{body}</article></body></html>"""


def collect(context, body: str) -> dict:
    page = context.new_page()
    try:
        page.set_content(SYNTHETIC.format(body=body))
        return page.evaluate(COLLECT)
    finally:
        page.close()


def test_overflow_check_sees_content_past_the_column(context):
    wide = "<pre style='overflow: visible'>" + "x" * 300 + "</pre>"
    assert collect(context, wide)["overflow"], "a 300-character line was not reported"
    cut = "<div style='overflow: hidden'><pre>" + "x" * 300 + "</pre></div>"
    assert collect(context, cut)["overflow"], "content cut off by overflow:hidden passed"
    scrolls = "<div style='overflow-x: auto'><pre>" + "x" * 300 + "</pre></div>"
    assert collect(context, scrolls)["overflow"] == [], "a scrolling box was reported"
    assert collect(context, scrolls)["sideways"], "a block that scrolls sideways passed"
    fits = "<div style='overflow-x: auto'><pre>" + "x" * 20 + "</pre></div>"
    assert collect(context, fits)["sideways"] == [], "a short line was reported"


def test_error_and_image_checks_can_fail(context):
    info = collect(context, "<div class='cell_output'><div class='output stderr'>"
                            "<pre>UserWarning: noise</pre></div></div>"
                            "<img src='data:image/png;base64,AAAA'>")
    assert info["errors"], "a stderr block was not reported"
    assert [img["ok"] for img in info["images"]] == [False], "a broken image passed"


def test_figure_scale_check_can_fail(context):
    drawn = ("<img src=\"data:image/svg+xml,<svg xmlns='http://www.w3.org/2000/svg' "
             "width='500' height='40'/>\"")
    shrunk = collect(context, f"<div class='cell_output'>{drawn} style='width: 250px'>"
                              "</div>")
    assert shrunk["shrunk"], "a figure shown at half its size passed"
    full = collect(context, f"<div class='cell_output'>{drawn}></div>")
    assert full["shrunk"] == [], "a figure shown at its own size was reported"
    prose = collect(context, f"{drawn} style='width: 250px'>")
    assert prose["shrunk"] == [], "an image outside an output was reported"


def test_machine_path_and_repr_checks_can_fail(context):
    for text in ("/tmp/int8-load-x1y2/big", "/work/main/data/model",
                 "/root/.cache/huggingface/hub", "lib/python3.11/site-packages/torch",
                 "&lt;torch._C.Generator at 0x7f3a2c1b9e10&gt;"):
        info = collect(context, f"<div class='cell_output'><pre>{text}</pre></div>")
        assert info["noise"], f"an output showing {text!r} passed"
    clean = collect(context, "<div class='cell_output'><pre>data/tiny-shakespeare: "
                             "6.3 M parameters, x &lt; 0x10</pre></div>"
                             "<p>The cache lives in /tmp/ on Linux.</p>")
    assert clean["noise"] == [], f"a clean output (or prose) was reported: {clean['noise']}"


def test_long_line_check_can_fail(context):
    long = collect(context, "<div class='cell_output'><pre>" + "tok, " * 30 + "</pre></div>")
    assert long["longLines"], "a 150-character output line passed"
    short = collect(context, "<div class='cell_output'><pre>" + ("x" * 120 + "\n") * 3 +
                             "</pre></div><p>" + "prose " * 40 + "</p>")
    assert short["longLines"] == [], f"lines of 120 characters were reported: {short}"


def test_text_table_check_can_fail(context):
    def pre(rows, width=12):
        lines = ["  ".join(f"{c:>{width}}" for c in row) for row in rows]
        return ("<div class='cell_output'><pre style='white-space: pre-wrap; "
                "font-family: monospace'>" + "\n".join(lines) + "</pre></div>")
    header = ["op", "calls", "self CPU", "CPU total", "self CPU %", "CPU time avg",
              "input shapes"]
    wide = pre([header] + [[f"aten::mm{i}", "40", "1.2ms", "2.4ms", "30%", "60us",
                            "[[8, 256], [256, 768]]"] for i in range(3)], width=16)
    assert collect(context, wide)["wrappedTables"], "a wrapped text table passed"
    narrow = pre([["mode", "ms", "x float"], ["w8a16", "3.1", "1.3"],
                  ["w8a8", "4.9", "0.8"]], width=6)
    assert collect(context, narrow)["wrappedTables"] == [], "a table that fits was reported"
    prose = ("<div class='cell_output'><pre style='white-space: pre-wrap'>" +
             "a long line of generated text, " * 12 + "</pre></div>")
    assert collect(context, prose)["wrappedTables"] == [], "wrapped prose was reported"
