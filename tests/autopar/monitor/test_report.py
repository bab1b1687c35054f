"""``autopar report``: the page's numbers are the plan's prediction, exactly; the page renders in
headless Chromium with no console errors and shows the timeline, memory, breakdown and run
figures; it fetches nothing; the CLI writes PNGs, reads `autopar plan --json` output, and
refuses an old plan in one line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from autopar.cli import main
from autopar.monitor import GAUGES
from autopar.monitor.report import report_html
from autopar.plan import Plan

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    *("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"),
    *("--disable-background-networking", "--disable-component-update", "--disable-sync"),
    *("--enable-logging=stderr", "--v=0"),
]


@pytest.fixture(scope="module")
def plan() -> Plan:
    """A PP2 × TP2 plan of a small GPT on four CPU ranks (its blocks split by TP), with its
    baselines."""
    from autopar import Cluster, Constraints, PlanRequest
    from autopar.planner import make_plan
    from autopar.zoo import GPT, GPTConfig

    with torch.device("meta"):
        meta = GPT(GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=64, block_size=64))
    cons = Constraints(tp=2, pp=2, dp=1)
    request = PlanRequest(model=meta, name="tiny", cluster=Cluster.preset("cpu", gpus_per_node=4),
                          global_batch=8, seq=64, dtype="fp32", constraints=cons)  # fmt: skip
    plan = make_plan(request).plan
    assert plan.strategy.tp == plan.strategy.pp == 2 and plan.tensor_parallel and plan.why
    return plan


def _metrics(plan: Plan, steps: int = 6) -> list[dict]:
    """Lines as ``Metrics(jsonl=…)`` writes them: every gauge per step, per-rank memory."""
    pred = plan.predicted["step_time_s"]
    lines: list[dict] = []
    for step in range(steps):
        line = {"step": step, **dict.fromkeys(GAUGES, 1.0), "step_time_s": pred * (1.1 + 0.01 * step)}
        lines.append(line | {"peak_memory_bytes": 3e8, "predicted_peak_memory_bytes": 2e8, "grad_norm": 0.5})
        if step % 2:  # profiled (Metrics(collectives_every=2))
            lines[-1] |= {"collective_s": 0.2 * pred, "predicted_comm_s": 0.1 * pred}
    ranks = [{"rank": r, "peak_memory_bytes": 3e8, "predicted_peak_memory_bytes": 2e8} for r in range(4)]
    lines.append({"step": steps - 1, "ranks": ranks})
    return lines


class _Cells(HTMLParser):
    """Every ``data-key`` → ``data-value`` of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, float] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("data-key") is not None:
            self.values[str(a["data-key"])] = float(str(a["data-value"]))


def test_the_page_numbers_are_the_plans_prediction(plan: Plan) -> None:
    page, pngs = report_html(plan)
    assert pngs == {}
    cells = _Cells()
    cells.feed(page)
    got, pred = cells.values, plan.predicted
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu"):
        assert got[f"predicted.{key}"] == pred[key], key
    assert got["predicted.peak_bytes"] == max(m["peak_bytes"] for m in pred["memory"])
    for name, seconds in pred["breakdown_s"].items():
        assert got[f"predicted.breakdown_s.{name}"] == seconds, name
    for m in pred["memory"]:
        for term in ("weights", "gradients", "optimizer", "activations", "loss", "comm_buffers", "reserve"):
            assert got[f"predicted.memory.{m['stage']}.{term}"] == m[term]
        assert got[f"predicted.memory.{m['stage']}.peak_bytes"] == m["peak_bytes"]
    for s in plan.stages:
        assert got[f"stages.{s.index}.time_per_micro_batch_s"] == s.time_per_micro_batch_s
    assert len(got) == 6 + len(pred["breakdown_s"]) + 8 * len(pred["memory"]) + 2 * len(plan.stages)
    rows = len(plan.why["alternatives"]) + len(plan.why["baselines"])
    why = page[page.index("Why this plan") :]
    assert why.count("<tr>") == 1 + rows and "zero3 data parallel" in why
    # self-contained: no scripts, nothing fetched (namespaces aside)
    assert "<script" not in page
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)|url\((?!#)|@import""", page)


def _chromium(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHROMIUM), *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (.ci/run installs it)")
def test_the_report_renders_in_headless_chromium(plan: Plan, tmp_path: Path) -> None:
    from PIL import Image

    broken = tmp_path / "broken.html"  # the console check sees an error when there is one
    broken.write_text("<html><body><script>console.error('boom'); nope();</script></body></html>")
    assert "CONSOLE" in _chromium(broken, tmp_path, "--dump-dom").stderr

    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(line) + "\n" for line in _metrics(plan)))
    out = tmp_path / "report.html"
    assert main([
        "report", str(tmp_path / "plan.json"), "--metrics", str(tmp_path / "run.jsonl"), "--out", str(out)
    ]) == 0  # fmt: skip
    dom = _chromium(out, tmp_path, "--dump-dom")
    assert dom.returncode == 0 and "CONSOLE" not in dom.stderr, dom.stderr[-2000:]
    for name in ("timeline", "breakdown", "memory", "run"):
        figure = re.search(rf'<figure id="{name}">(.*?)</figure>', dom.stdout, re.S)
        assert figure and "<svg" in figure.group(1), name
        assert len(re.findall(r"<path", figure.group(1))) > 10, name  # it drew bars
    assert "time in collectives (median of 3 profiled" in dom.stdout and "gradient norm" in dom.stdout
    timeline = re.search(r'<figure id="timeline">(.*?)</figure>', dom.stdout, re.S)
    assert timeline and "stage 1" in timeline.group(1) and "idle (bubble)" in timeline.group(1)
    shot = tmp_path / "shot.png"
    run = _chromium(out, tmp_path, "--window-size=1200,2400", f"--screenshot={shot}")
    assert run.returncode == 0 and "CONSOLE" not in run.stderr
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 2400)
    colours = {c for _, c in image.getcolors(maxcolors=1 << 20) or []}
    assert {(76, 120, 168), (245, 133, 24)} <= colours  # forward and backward bars are on screen


def test_the_cli_writes_pngs_and_reads_plan_json_output(plan: Plan, tmp_path: Path, capsys) -> None:
    whole = {"model": "tiny", "plan": plan.to_dict(), "alternatives": []}  # `autopar plan --json`
    (tmp_path / "p.json").write_text(json.dumps(whole))
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "p.json"), "--out", str(out), "--png", "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["png"] == [str(tmp_path / f"r-{n}.png") for n in ("timeline", "breakdown", "memory")]
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in said["png"])
    assert out.stat().st_size == said["bytes"]


def test_an_old_plan_or_a_bad_file_is_one_line(plan: Plan, tmp_path: Path, capsys) -> None:
    old = plan.to_dict()
    del old["predicted"]["stage_times"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "plan.json").write_text(plan.to_json())
    cases = [
        (["report", str(tmp_path / "old.json"), "--out", str(tmp_path / "a.html")], "make it again"),
        (["report", str(tmp_path / "missing.json"), "--out", str(tmp_path / "a.html")], "can't read plan"),
        (["report", str(tmp_path / "plan.json"), "--out", str(tmp_path / "no" / "a.html")], "does not exist"),
        (["report", str(tmp_path / "plan.json"), "--metrics", str(tmp_path / "bad.jsonl"),
          "--out", str(tmp_path / "a.html")], "can't read metrics"),
    ]  # fmt: skip
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    assert not (tmp_path / "a.html").exists()


def test_a_long_timeline_is_drawn_as_an_image_inside_its_svg(plan: Plan) -> None:
    """Past ``RASTER_ABOVE`` segments the bars are rasterised: one embedded PNG, not thousands of
    paths (a 16-stage plan of 192 micro-batches is 6 MB of vector paths)."""
    from autopar.cost_models.timeline import simulate, stage_times_from_dicts
    from autopar.monitor import figures
    from autopar.strategy import Strategy

    times = stage_times_from_dicts(plan.predicted["stage_times"])
    events = simulate(Strategy(pp=2, dp=1, global_batch=1024, micro_batch=1, seq=64), times, 1e-4)
    assert len(events) > figures.RASTER_ABOVE
    svg, _ = figures.render(figures.timeline_figure(plan, events), "timeline", with_png=False)
    assert svg.count("<image") == 1 and len(svg) < 500_000


def test_the_dry_run_sits_beside_the_predicted_memory(plan: Plan, tmp_path: Path, capsys) -> None:
    """``--dryrun`` (``autopar dryrun --json``): each distinct rank's dry-run peak next to the cost
    model's, the numbers exactly the dry run's; another plan's dry run, or a file that is not a
    dry run, is one line and nothing written."""
    from dataclasses import replace

    from autopar.measure.dryrun import dry_run, rank_roles
    from autopar.zoo import GPT, GPTConfig

    cfg = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=64, block_size=64)
    runs = [dry_run(lambda: GPT(cfg), plan, rank, steps=1) for rank, _ in rank_roles(plan)]
    assert all(r.ok for r in runs), [r.failure for r in runs]
    (tmp_path / "d.json").write_text(
        json.dumps({"plan": plan.to_dict(), "ranks": [r.to_dict() for r in runs]})
    )
    (tmp_path / "plan.json").write_text(plan.to_json())
    out = tmp_path / "r.html"
    assert (
        main(["report", str(tmp_path / "plan.json"), "--dryrun", str(tmp_path / "d.json"), "--out", str(out)])
        == 0
    )
    cells = _Cells()
    cells.feed(out.read_text())
    for r in runs:
        assert cells.values[f"dryrun.{r.rank}.peak_bytes"] == r.peak_bytes > 0
        assert cells.values[f"dryrun.{r.rank}.predicted_peak_bytes"] == r.predicted_peak_bytes > 0
    other = replace(plan, strategy=replace(plan.strategy, micro_batch=2))
    (tmp_path / "other.json").write_text(
        json.dumps({"plan": other.to_dict(), "ranks": [r.to_dict() for r in runs]})
    )
    cases = [("other.json", "another plan"), ("plan.json", "not a dry run"), ("missing.json", "can't read")]
    for name, says in cases:
        argv = [
            "report",
            str(tmp_path / "plan.json"),
            "--dryrun",
            str(tmp_path / name),
            "--out",
            str(tmp_path / "b.html"),
        ]
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
    assert not (tmp_path / "b.html").exists()
