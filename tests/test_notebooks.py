"""The notebooks: committed with their figures, drawn inline, and re-executed top to bottom here (CPU, small sizes).

Each notebook must produce exactly its figures (``IMAGES``: PNG outputs, counted) both in the committed file, so a
reader sees them without running anything, and when executed again. ``matplotlib.use(...)`` is not allowed in a
notebook: it replaces the inline backend and ``plt.show()`` then draws nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
IMAGES = {
    "01_kernels_tour.ipynb": 4,  # the committed bench/results PNGs; the MLA decode grids
    "02_prefix_cache_and_snapshots.ipynb": 2,
    "03_routing_and_scheduling.ipynb": 3,
    "04_engine.ipynb": 1,  # where the engine's step time goes
    "05_fleet.ipynb": 2,  # bench_fleet: simulated against measured; the step-time profile's fit
    "mla_context_attention.ipynb": 3,  # FP8 error across scales; the H200 fixed grid and the --random grids
}


def _read(path: Path):
    nbformat = pytest.importorskip("nbformat", reason="install the 'notebooks' extra to read notebooks")
    return nbformat.read(path, as_version=4)


def _outputs(nb) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def _images(nb) -> int:
    return sum(1 for o in _outputs(nb) if "image/png" in o.get("data", {}))


def test_every_notebook_has_an_image_count():
    assert {p.name for p in NOTEBOOKS} == set(IMAGES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_with_inline_figures(path: Path):
    nb = _read(path)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "matplotlib.use(" not in code, f"{path.name}: matplotlib.use() replaces the inline backend"
    assert _images(nb) == IMAGES[path.name], f"{path.name}: commit it executed, with its figures"
    assert not [o for o in _outputs(nb) if o.get("output_type") == "error"]
    big = max((len(o["data"]["image/png"]) for o in _outputs(nb) if "image/png" in o.get("data", {})), default=0)
    assert big < 200_000, f"{path.name}: a {big:,}-byte figure; draw it at a lower dpi"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_and_draws(path: Path, tmp_path: Path) -> None:
    nbclient = pytest.importorskip("nbclient", reason="install the 'notebooks' extra to run notebooks")
    nb = _read(path)
    for c in nb.cells:
        if c.cell_type == "code":
            c.outputs = []
    client = nbclient.NotebookClient(
        nb, timeout=840, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [o for o in _outputs(nb) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    assert _images(nb) == IMAGES[path.name], f"{path.name}: expected {IMAGES[path.name]} figures, got {_images(nb)}"


def _png_width(data: str) -> int:
    """Width in pixels from a base64 PNG's IHDR chunk (bytes 16-19, big-endian)."""
    import base64

    raw = base64.b64decode(data)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR", "not a PNG"
    return int.from_bytes(raw[16:20], "big")


def test_kernels_tour_figures_are_wide_and_keep_legends_off_the_data():
    """Issue 32: notebook 01's figures were stored 760 px wide (the multi-panel replay figure illegible) and a
    legend covered the last group of bars. Every figure is now at least 1,000 px wide, and every legend the
    notebook draws is anchored beside the axes."""
    path = next(p for p in NOTEBOOKS if p.name == "01_kernels_tour.ipynb")
    nb = _read(path)
    widths = [_png_width(o["data"]["image/png"]) for o in _outputs(nb) if "image/png" in o.get("data", {})]
    assert len(widths) == IMAGES[path.name]
    assert min(widths) >= 1000, widths
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    legends = code.count(".legend(")
    assert legends >= 1 and code.count("bbox_to_anchor=(1.0") == legends, "a legend inside the axes"
