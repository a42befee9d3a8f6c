"""Report directory: per load level AIPerf's exports (factory/verify/aiperf_export.py), a sweep
summary, a Markdown summary, PNG plots and one self-contained HTML page."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from factory.verify.aiperf_export import write_level
from factory.verify.result import Gate

PARETO_PLOT = "pareto_throughput_vs_interactivity.png"
PLOTS = {
    "throughput_vs_concurrency.png": ("Output token throughput", [("output_token_throughput", "avg", "tokens/s")]),
    "ttft_vs_concurrency.png": ("Time to first token", [("time_to_first_token", q, "ms") for q in ("p50", "p90", "p99")]),
    "itl_vs_concurrency.png": ("Inter-token latency", [("inter_token_latency", q, "ms") for q in ("p50", "p90", "p99")]),
}


def _axes(title: str):
    """A figure in the report's size, headless."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path) -> str:
    import matplotlib.pyplot as plt

    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.name


def plot(levels: dict[int, dict], out: Path) -> list[str]:
    names = []
    xs = sorted(levels)
    for name, (title, series) in PLOTS.items():
        fig, ax = _axes(title)
        for metric, stat, unit in series:
            ax.plot(xs, [levels[x][metric][stat] or 0 for x in xs], marker="o", label=f"{stat} ({unit})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrency")
        names.append(_save(fig, ax, out / name))
    return names


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (higher is better on each), by the first axis."""
    front = [p for p in points if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in points)]
    return sorted(front)


def plot_pareto(levels: dict[int, dict], out: Path) -> str:
    """Throughput per instance against interactivity (tok/s per user, median), one point per level:
    how serving configurations are compared (InferenceMAX, AIPerf's Pareto plots)."""
    points = {c: (m["output_token_throughput_per_user"]["p50"], m["output_token_throughput"]["avg"])
              for c, m in sorted(levels.items()) if m["output_token_throughput_per_user"]["p50"] is not None}
    fig, ax = _axes("Throughput vs interactivity")
    ax.scatter([x for x, _ in points.values()], [y for _, y in points.values()], marker="o")
    for c, (x, y) in points.items():
        ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    front = pareto_front(list(points.values()))
    ax.plot([x for x, _ in front], [y for _, y in front], linestyle="--", label="Pareto front")
    ax.set_xlabel("tokens/s per user (p50)")
    ax.set_ylabel("output tokens/s per instance")
    return _save(fig, ax, out / PARETO_PLOT)


def ecdf(values: list[float]) -> tuple[list[float], list[float]]:
    """The empirical distribution: sorted values against the fraction of requests at or below each."""
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


DISTRIBUTIONS = {"ttft_distribution.png": ("Time to first token, per level", "ttft_p99_ms",
                                           lambda r: r.ttft * 1000 if r.ttft is not None else None),
                 "itl_distribution.png": ("Inter-token latency, per level", "itl_p99_ms",
                                          lambda r: r.inter_token_latency * 1000 if r.inter_token_latency else None)}


def plot_distributions(runs: dict[int, tuple], slo: dict[str, float | None], out: Path) -> list[str]:
    """Each level's requests as a cumulative distribution (AIPerf's per-request view), with the SLO's limit."""
    names = []
    for name, (title, limit_name, value) in DISTRIBUTIONS.items():
        fig, ax = _axes(title)
        for level, (_, records) in sorted(runs.items()):
            values = [v for r in records if r.error is None and (v := value(r)) is not None]
            if values:
                ax.step(*ecdf(values), where="post", label=f"c={level}")
        if slo.get(limit_name) is not None:
            ax.axvline(slo[limit_name], color="#b00", linestyle="--", label=f"SLO {slo[limit_name]:g} ms")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        names.append(_save(fig, ax, out / name))
    return names


def plot_goodput(levels: dict[int, dict], slo: dict[str, float | None], out: Path) -> str:
    """Requests/s against the requests/s that met every SLO, per level."""
    targets = ", ".join(f"{k.removesuffix('_ms')} ≤ {v:g} ms" for k, v in slo.items() if v is not None)
    fig, ax = _axes(f"Goodput against the SLOs ({targets or 'none set'})")
    xs = sorted(levels)
    positions = range(len(xs))
    ax.bar([x - 0.2 for x in positions], [levels[c]["request_throughput"]["avg"] for c in xs], 0.4, label="requests/s")
    ax.bar([x + 0.2 for x in positions], [levels[c]["goodput"]["avg"] for c in xs], 0.4, label="goodput")
    ax.set_xticks(list(positions), [str(c) for c in xs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("requests/s")
    return _save(fig, ax, out / "goodput_vs_slo.png")


def sweep_table(levels: dict[int, dict]) -> str:
    lines = ["| concurrency | output tok/s | req/s | goodput | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(levels):
        m = levels[c]

        def f(metric: str, stat: str) -> str:
            value = m[metric][stat]
            return "-" if value is None else f"{value:.1f}"

        lines.append(f"| {c} | {f('output_token_throughput', 'avg')} | {m['request_throughput']['avg']:.2f} | "
                     f"{m['goodput']['avg']:.2f} | {f('time_to_first_token', 'p50')} | {f('time_to_first_token', 'p99')} | "
                     f"{f('inter_token_latency', 'p50')} | {f('inter_token_latency', 'p99')} | "
                     f"{m['error_request_count']['avg']} |")
    return "\n".join(lines)


def sweep_summary(result: dict, run_dirs: dict[int, Path]) -> dict:
    """The levels side by side, each pointing at its AIPerf run directory."""
    def row(level: int, m: dict) -> dict:
        return {"concurrency": level, "run_dir": run_dirs[level].name,
                "output_token_throughput": m["output_token_throughput"]["avg"],
                "output_token_throughput_per_user_p50": m["output_token_throughput_per_user"]["p50"],
                "request_throughput": m["request_throughput"]["avg"], "goodput": m["goodput"]["avg"],
                "time_to_first_token_p50_ms": m["time_to_first_token"]["p50"],
                "time_to_first_token_p99_ms": m["time_to_first_token"]["p99"],
                "inter_token_latency_p50_ms": m["inter_token_latency"]["p50"],
                "inter_token_latency_p99_ms": m["inter_token_latency"]["p99"],
                "error_request_count": m["error_request_count"]["avg"]}

    return {"model": result["model"], "url": result["url"],
            "levels": [row(level, m) for level, m in sorted(result["performance"].items())]}


def write_report(result: dict, gates: list[Gate], runs: dict[int, tuple], out: Path) -> Path:
    """`gates` in the order the harness ran them; `runs` maps each level to its LoadSettings and
    request records; `result` holds the measurements behind them (summary.json)."""
    out.mkdir(parents=True, exist_ok=True)
    levels = {int(c): m for c, m in result["performance"].items()}
    run_dirs = {level: write_level(out, result["url"], settings, levels[level], records)
                for level, (settings, records) in runs.items()}
    (out / "sweep_summary.json").write_text(json.dumps(sweep_summary(result, run_dirs), indent=2))
    slo = result.get("slo_targets", {})
    plots = (plot(levels, out) + [plot_pareto(levels, out)] + plot_distributions(runs, slo, out)
             + [plot_goodput(levels, slo, out)]) if levels else []
    verdict = "PASSED" if result["passed"] else "FAILED"
    table = "\n".join(f"| {g.id} | {'pass' if g.passed else 'FAIL'} | {g.detail[:160].replace('|', '/')} |" for g in gates)
    skipped = result.get("skipped", {})
    markdown = (f"# Test report: {result['model']} at {result['url']} — {verdict}\n\n"
                f"| gate | result | detail |\n|---|---|---|\n{table}\n"
                + "".join(f"| {check} | skipped | {reason} |\n" for check, reason in skipped.items())
                + f"\n## Performance\n\n{sweep_table(levels)}\n\n"
                + "".join(f"![{p}]({p})\n" for p in plots))
    (out / "summary.md").write_text(markdown)
    (out / "summary.json").write_text(json.dumps({**result, "gates": [g.model_dump() for g in gates]}, indent=2))
    images = "".join(f'<img alt="{p}" src="data:image/png;base64,{base64.b64encode((out / p).read_bytes()).decode()}">'
                     for p in plots)
    gate_html = "".join(f"<tr class={'ok' if g.passed else 'bad'}><td>{html.escape(g.id)}</td>"
                        f"<td>{'pass' if g.passed else 'FAIL'}</td><td>{html.escape(g.detail[:300])}</td></tr>" for g in gates)
    gate_html += "".join(f"<tr><td>{html.escape(check)}</td><td>skipped</td><td>{html.escape(reason)}</td></tr>"
                         for check, reason in skipped.items())
    (out / "index.html").write_text(
        "<!doctype html><meta charset=utf-8><title>inferkiln test report</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px}.ok td:nth-child(2){color:#080}.bad td:nth-child(2){color:#b00}"
        "img{max-width:32%;margin:4px}</style>"
        f"<h1>{html.escape(result['model'])} — {verdict}</h1><p>{html.escape(result['url'])}</p>"
        f"<h2>Gates</h2><table><tr><th>gate</th><th>result</th><th>detail</th></tr>{gate_html}</table>"
        f"<h2>Performance</h2><pre>{html.escape(sweep_table(levels))}</pre>{images}")
    return out
