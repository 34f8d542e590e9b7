"""The HTML reports as a browser shows them: headless Chromium loads each one,
reports no console or resource errors, and its screenshot shows rendered figures.

Chromium is a real dependency of the test suite: ``.ci/run`` installs it from
the OS packages and sets BATCHSIM_REQUIRE_CHROMIUM=1, which turns a missing
browser into a failure instead of a skip.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from reports.presentation.report import regenerate
from sim.cli import main as sim_main

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")


@pytest.fixture(scope="module")
def chromium() -> str:
    path = next((p for p in CANDIDATES if os.path.exists(p)), None)
    if path is None:
        if os.environ.get("BATCHSIM_REQUIRE_CHROMIUM") == "1":
            pytest.fail("BATCHSIM_REQUIRE_CHROMIUM=1 but no Chromium at " + ", ".join(CANDIDATES))
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    return path


def _flags(tmp: Path) -> list[str]:
    return ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--no-first-run", "--hide-scrollbars", f"--user-data-dir={tmp / 'chromium-profile'}"]


def load_in_chromium(chromium: str, html: Path, tmp: Path) -> tuple[str, np.ndarray]:
    """(DOM after load, screenshot as an RGB array); fails on console or resource errors."""
    dom = subprocess.run([chromium, *_flags(tmp), "--enable-logging=stderr", "--virtual-time-budget=3000",
                          "--dump-dom", html.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    errors = [line for line in dom.stderr.splitlines()
              if "CONSOLE" in line or "Uncaught" in line or "Failed to load resource" in line
              or "ERR_FILE_NOT_FOUND" in line]
    assert not errors, errors
    shot = tmp / f"{html.parent.name}.png"
    run = subprocess.run([chromium, *_flags(tmp), f"--screenshot={shot}", "--window-size=1280,1800",
                          "--virtual-time-budget=3000", html.as_uri()], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    import matplotlib.image as mpimg
    return dom.stdout, (mpimg.imread(shot)[..., :3] * 255).astype(np.uint8)


def assert_figures_rendered(dom: str, pixels: np.ndarray, html: Path) -> None:
    """Every <img> is embedded or names a file that exists, and the screenshot is a page with plots on it:
    a blank page or broken-image icons give a few colours, a rendered matplotlib figure
    hundreds (anti-aliased lines and text)."""
    sources = re.findall(r'<img[^>]*src="([^"]+)"', dom)
    assert sources, "no figures in the report"
    for src in sources:
        if src.startswith("data:image/"):
            continue
        assert (html.parent / src).is_file(), f"{html}: <img src={src}> does not exist"
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    non_white = float((pixels.min(axis=2) < 240).mean())
    assert len(colours) > 200, f"{html}: only {len(colours)} colours on screen"
    assert non_white > 0.03, f"{html}: {100 * non_white:.1f}% of the screen is not white"


def test_run_report_in_chromium(chromium: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert sim_main(["run", str(ROOT / "workloads" / "mixed_lengths.yaml"), "--out", str(out),
                     "--set", "num_requests=60", "--quiet"]) == 0
    regenerate(out)
    dom, pixels = load_in_chromium(chromium, out / "report.html", tmp_path)
    assert "Run report" in dom
    assert_figures_rendered(dom, pixels, out / "report.html")


def test_sweep_report_in_chromium(chromium: str, tmp_path: Path) -> None:
    import yaml
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "chromium-sweep", "base": str(ROOT / "workloads" / "mixed_lengths.yaml"),
        "set": {"num_requests": 40},
        "vary": {"policy.kind": ["vllm", "sarathi"], "arrivals.rate": [2, 8]},
        "repetitions": 1, "out": str(tmp_path / "sweep")}))
    assert sim_main(["sweep", str(spec), "-j", "1", "--quiet"]) == 0
    html = tmp_path / "sweep" / "report.html"
    if not html.is_file():
        regenerate(tmp_path / "sweep")
    dom, pixels = load_in_chromium(chromium, html, tmp_path)
    assert "Sweep report" in dom
    assert_figures_rendered(dom, pixels, html)


def test_checks_catch_a_broken_page(chromium: str, tmp_path: Path) -> None:
    """The checks above can fail: a page whose figure is missing fails them."""
    page = tmp_path / "broken" / "report.html"
    page.parent.mkdir()
    page.write_text('<html><body><h1>Run report</h1><img src="figures/missing.png"></body></html>')
    with pytest.raises(AssertionError):
        dom, pixels = load_in_chromium(chromium, page, tmp_path)
        assert_figures_rendered(dom, pixels, page)


def test_validation_report_in_chromium(chromium: str, tmp_path: Path) -> None:
    """`sim validate --measured` (no torch, no server): its report.html in the browser."""
    from test_server_validate import PROFILE, WORKLOAD, bench_dict, write
    wl = write(tmp_path, WORKLOAD, "w.yaml")
    bench = write(tmp_path, bench_dict())
    out = tmp_path / "validation"
    assert sim_main(["validate", str(wl), "--measured", str(bench), "--profile", str(PROFILE),
                     "--out", str(out)]) == 0
    dom, pixels = load_in_chromium(chromium, out / "report.html", tmp_path)
    assert "Verdict" in dom and "against a vLLM server" in dom
    assert_figures_rendered(dom, pixels, out / "report.html")
