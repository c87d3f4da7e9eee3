"""The documentation site in a real browser: at a 1280-pixel window no code block or table of
any guide, the index or the API pages is cut off behind a scroll bar.

It needs Sphinx (the ``docs`` extra) and a headless Chromium (Debian's ``chromium``); CI runs
it after building the site. It reads ``docs/_build/html`` when that is there and builds the
site into a temporary folder when not. Screenshots of every checked page are written beside
the pages (``*.check.png``) for a person to look at.
"""

import json
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
WIDTH = 1280

# Marks, in the page's DOM, each code block and table wider than the box it sits in.
PROBE = """<script>
window.addEventListener('load', () => {
  const out = [];
  document.querySelectorAll('article pre, article table').forEach(el => {
    const box = el.closest('.highlight, .table-wrapper, .pst-scrollable-table-container') || el;
    const w = Math.max(el.scrollWidth, el.getBoundingClientRect().width);
    if (w > box.clientWidth + 1 || el.scrollWidth > el.clientWidth + 1)
      out.push(el.tagName + ' ' + Math.round(w) + ' > ' + box.clientWidth + ': ' +
               (el.textContent || '').trim().slice(0, 60));
  });
  const d = document.createElement('pre');
  d.id = 'mpjax-overflow';
  d.textContent = 'MPJAX-OVERFLOW' + JSON.stringify(out) + 'MPJAX-END';
  document.body.appendChild(d);
});
</script>"""


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _site(tmp_path: pathlib.Path) -> pathlib.Path:
    built = ROOT / "docs" / "_build" / "html"
    if (built / "index.html").exists():
        return built
    pytest.importorskip("sphinx")
    out = tmp_path / "html"
    subprocess.run(
        ["sphinx-build", "-q", "-b", "html", str(ROOT / "docs"), str(out)], check=True, cwd=ROOT
    )
    return out


def _browser(chromium: str, profile: pathlib.Path, *args: str) -> str:
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--virtual-time-budget=3000",
    ]  # fmt: skip
    result = subprocess.run(
        [chromium, *flags, *args], capture_output=True, text=True, timeout=120, check=False
    )
    return result.stdout


@pytest.mark.slow
def test_no_code_block_or_table_is_cut_off_at_1280_pixels(tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("needs a headless Chromium (Debian: apt-get install chromium)")
    site = _site(tmp_path)
    pages = [site / "index.html", site / "api.html", *sorted((site / "guides").glob("*.html"))]
    pages += [site / "_autosummary" / f"mpjax.{n}.html" for n in ("Policy", "audit", "compare")]
    pages = [p for p in pages if p.exists() and not p.name.endswith(".check.html")]
    assert len(pages) >= 15, pages
    cut = {}
    for page in pages:
        probe = page.with_name(page.stem + ".check.html")
        probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
        dom = _browser(chromium, tmp_path / "profile", f"--window-size={WIDTH},900",
                       "--dump-dom", probe.as_uri())  # fmt: skip
        found = re.search(r"MPJAX-OVERFLOW(\[.*?\])MPJAX-END", dom, flags=re.S)
        assert found, f"the probe did not run on {page.name}"
        wide = json.loads(found.group(1).replace("&gt;", ">").replace("&lt;", "<"))
        if wide:
            cut[str(page.relative_to(site))] = wide
        shot = page.with_name(page.stem + ".check.png")
        _browser(chromium, tmp_path / "profile", f"--window-size={WIDTH},1600",
                 f"--screenshot={shot}", page.as_uri())  # fmt: skip
        probe.unlink()
    assert not cut, f"cut off at {WIDTH} pixels: {cut}"
