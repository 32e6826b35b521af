"""The HTML report in a real browser (issue 43: "check it in a real browser"): ``lowbit report`` on the two
committed CPU-study fixtures (mlp/digits, and small_cnn/MNIST-1D with its diverged 1bitSGD* run), opened by
headless Chromium. Every image loads, nothing is wider than a 1400-pixel window, and a screenshot is taken
(kept in the test's tmp folder, to look at). Slow, and skipped where no Chromium is installed
(``apt-get install chromium-headless-shell``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lowbit.lab.cli import main

pytest.importorskip("matplotlib")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-headless-shell", "chromium-browser",
                                                 "google-chrome")) if p), None)

#: Run in the page once it has loaded: which images failed, and whether anything is wider than the window.
_PROBE = """<script>window.addEventListener('load', () => {
  const broken = [...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.getAttribute('src'));
  const wide = [...document.querySelectorAll('table, img')].filter(e => e.getBoundingClientRect().right > innerWidth)
    .map(e => e.tagName + ' ' + (e.getAttribute('src') || e.rows[0].innerText.slice(0, 40)));
  document.body.setAttribute('data-probe', JSON.stringify({images: document.images.length, broken, wide,
    scroll: document.documentElement.scrollWidth, width: innerWidth}));
});</script></body>"""


def _chromium(*args: str) -> str:
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          "--window-size=1400,3000", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (apt-get install chromium-headless-shell)")
def test_the_report_renders_in_chromium(tmp_path: Path) -> None:
    results = tmp_path / "study" / "results.jsonl"
    results.parent.mkdir()
    results.write_text("".join((FIXTURES / name / "results.jsonl").read_text()
                               for name in ("study_cpu_default", "study_cpu_default_small_cnn_mnist1d")))
    assert main(["report", str(results.parent), "--out", str(tmp_path / "report")]) in (0, None)
    index = tmp_path / "report" / "index.html"
    page = index.read_text(encoding="utf-8")
    assert "mathdefault" not in page and "$\\" not in page  # no raw mathtext in the page's words either
    assert "✗ diverged (8.9%)" in page

    probe = index.with_name("probe.html")
    probe.write_text(page.replace("</body>", _PROBE), encoding="utf-8")
    dom = _chromium("--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    found = re.search(r"data-probe=\"([^\"]*)\"", dom)
    assert found, dom[-2000:]
    seen = json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    assert seen["images"] == 7 and seen["broken"] == [], seen  # Figures 5 (2), 6-9 (2), 12-15 (1), 16 (2)
    assert seen["wide"] == [] and seen["scroll"] <= seen["width"], seen  # no table or figure past the window

    shot = tmp_path / "report.png"
    _chromium(f"--screenshot={shot}", index.as_uri())
    assert shot.stat().st_size > 50_000  # a page of figures, not a blank one
    Image = pytest.importorskip("PIL.Image")  # noqa: N806
    with Image.open(shot) as im:
        assert im.size == (1400, 3000)
        lo, hi = im.convert("L").getextrema()
        assert hi - lo > 200 and len(im.convert("L").resize((140, 300)).getcolors(256) or []) > 20  # drawn
