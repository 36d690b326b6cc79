"""Render a suite run (``bench.suite.run``'s dict) as a Markdown table with the targets, a CSV and a PNG plot.

Rows are keyed by provider name (``bench.names``); tables and plots show labels.
"""

from __future__ import annotations

import csv
import io
import json
import pathlib

from bench.names import JAX_OURS, JAX_PEERS, OURS, TORCH_OURS, label, ordered

# Fractions of the same run's copy bandwidth that the JAX default (``impl=None``: "auto", or "pallas" in runs
# made before it existed) must reach.
TARGETS = (("fwd", lambda n: n <= 16384, 0.95, "N ≤ 16384"), ("bwd", lambda n: n <= 16384, 0.90, "N ≤ 16384"),
           ("fwd", lambda n: n >= 32768, 0.85, "N ≥ 32768"), ("bwd", lambda n: n >= 32768, 0.85, "N ≥ 32768"),
           ("fwd", lambda n: True, 0.80, "every shape"), ("bwd", lambda n: True, 0.80, "every shape"))
SMALL_CALL_RATIO = 2.0  # our torch backends' small call vs torch F.rms_norm, wall time per call
ENV_KEYS = ("gpu", "driver", "jax", "torch", "triton", "date", "dtype", "casting", "copy_tbps")
CSV_KEYS = ("provider", "mode", "m", "n", "us", "tbps", "pct_copy", "peak_mb", "small", "x_torch", "error")


def pct(row: dict, copy: float) -> float | None:
    """% of the copy bandwidth measured in the row's own run (``copy`` for rows that lack it)."""
    if "tbps" not in row:
        return None
    return row.get("pct_copy", 100 * row["tbps"] / copy)


KERNEL_TIMER = "kernels"  # env["timer"] (bench.suite) of runs that time every provider by its kernels' durations
EVENTS_MARK = "†"


def event_timed(row: dict, env: dict) -> bool:
    """Whether a torch provider's row was timed by CUDA events around one call (host launch included): the rows of
    runs made before the suite timed every provider by its kernels (merged files tag them ``timer="events"``)."""
    if row.get("timer") == "events":
        return True
    return env.get("timer") != KERNEL_TIMER and row["provider"] not in JAX_OURS + JAX_PEERS and not row.get("small")


def cell(row: dict | None, env: dict, error: str = "err") -> str:
    """A row's ``TB/s (% of copy)``, marked ``EVENTS_MARK`` where timed by CUDA events; "–" for no row, ``error``
    for a failed one (the tables here and the README summary)."""
    if row is None:
        return "–"
    if "tbps" not in row:
        return error
    return f"{row['tbps']:.2f} ({pct(row, env['copy_tbps']):.0f}%){EVENTS_MARK * event_timed(row, env)}"


def index(rows: list[dict]) -> dict:
    return {(r["provider"], r["mode"], r["m"], r["n"], bool(r.get("small"))): r for r in rows}


def _shapes(rows: list[dict]) -> list[tuple[int, int]]:
    return sorted({(r["m"], r["n"]) for r in rows if not r.get("small")}, key=lambda s: (s[1] > 16384, s[0], s[1]))


def markdown(result: dict) -> str:
    env, rows = result["env"], result["rows"]
    copy = env["copy_tbps"]
    idx = index(rows)
    provs = ordered(r["provider"] for r in rows)
    out = [f"# RMSNorm benchmark: {env['gpu']}, {env['dtype']}, casting={env['casting']}", "",
           f"{env['date']} · driver {env['driver']} · jax {env['jax']} · torch {env['torch']} · triton "
           f"{env['triton']} · copy bandwidth (torch `copy_`, read + write, this run): **{copy:.2f} TB/s**"
           + (f" (runs merged; each row's % uses its own run's copy: {env['copy_note']} TB/s)" if "copy_note" in env
              else ""), "",
           "TB/s (% of copy). Bytes: fwd 2·M·N·s, bwd 3·M·N·s, fwd+bwd 5·M·N·s. `err`: the provider failed there "
           "(see the CSV). Made by `python -m bench`. " + timer_note(result), ""]
    out += targets(result) + [""]
    wide = [p for p in provs if any(r["provider"] == p and not r.get("small") for r in rows)]
    for mode in ("fwd", "bwd", "fwd+bwd"):
        out += [f"## {mode}", "", "| M×N | " + " | ".join(map(label, wide)) + " | best peer |",
                "|---|" + "---|" * (len(wide) + 1)]
        for m, n in _shapes(rows):
            cells = [cell(idx.get((p, mode, m, n, False)), env) for p in wide]
            peer = best_peer(idx, provs, mode, m, n)
            out.append(f"| {m}×{n} | " + " | ".join(cells) + f" | {label(peer[0]) if peer else '–'} |")
        out.append("")
    small = [r for r in rows if r.get("small")]
    if small:
        ms = sorted({r["m"] for r in small})
        out += ["## Small calls (N = 4096): host-bound µs per call (× torch F.rms_norm)", "",
                "| provider | " + " | ".join(f"M={m} {mode}" for m in ms for mode in ("fwd", "fwd+bwd")) + " |",
                "|---|" + "---|" * (2 * len(ms))]
        for p in provs:
            cells = []
            for m in ms:
                for mode in ("fwd", "fwd+bwd"):
                    r, t = idx.get((p, mode, m, 4096, True)), idx.get(("torch_native", mode, m, 4096, True))
                    ok = r is not None and "us" in r
                    x = _x_torch(r, t) if ok else None
                    cells.append(f"{r['us']:.0f}" + (f" ({x:.1f}×)" if x is not None else "") if ok else "–")
            if any(c != "–" for c in cells):
                out.append(f"| {label(p)} | " + " | ".join(cells) + " |")
        out.append("")
    mem = [r for r in rows if "peak_mb" in r and r["mode"] == "fwd+bwd"]
    if mem:
        big = max((r["m"] * r["n"], r["m"], r["n"]) for r in mem)[1:]
        out += [f"## Peak extra device memory of one fwd+bwd at {big[0]}×{big[1]} (MB)", "",
                "| provider | MB |", "|---|---|"]
        out += [f"| {label(r['provider'])} | {r['peak_mb']:.0f} |" for r in mem if (r["m"], r["n"]) == big]
    return "\n".join(out) + "\n"


def timer_note(result: dict) -> str:
    """How the table's rows were timed: every provider by its kernels' durations, and which rows (``EVENTS_MARK``)
    by CUDA events around one call instead."""
    env, rows = result["env"], [r for r in result["rows"] if "tbps" in r]
    events = sum(event_timed(r, env) for r in rows)
    note = ("Every provider is timed by its kernels' own durations (CUPTI, mean of 20 calls, inputs rotated past "
            "L2), torch's as JAX's")
    if not events:
        return note + "."
    return (note + f", but the {events} rows marked {EVENTS_MARK}: torch providers timed by CUDA events around one "
            "call (`triton.testing.do_bench`), which include its host launch (most of a small call's time).")


def best_peer(idx: dict, provs: list[str], mode: str, m: int, n: int) -> tuple[str, float] | None:
    peers = [(p, idx[(p, mode, m, n, False)]["tbps"]) for p in provs
             if p not in OURS and "tbps" in idx.get((p, mode, m, n, False), {})]
    return max(peers, key=lambda t: t[1]) if peers else None


def targets(result: dict) -> list[str]:
    """The targets, each with its measured value and a ✓/✗, for the JAX default (and our torch backends)."""
    env, rows = result["env"], result["rows"]
    copy, idx = env["copy_tbps"], index(rows)
    shapes = _shapes(rows)
    main = judged(rows)
    lines = [f"## Targets ({label(main)}, `impl={'None' if main == 'auto' else repr(main)}`, unless named)", "",
             "| target | measured | met |", "|---|---|---|"]
    for mode, where, frac, text in TARGETS:
        vals = [(m, n, idx.get((main, mode, m, n, False), {})) for m, n in shapes if where(n)]
        vals = [(m, n, r["tbps"], pct(r, copy)) for m, n, r in vals if "tbps" in r]
        if vals:
            m, n, tbps, share = min(vals, key=lambda t: t[3])
            lines.append(f"| {mode} ≥ {frac:.0%} of copy, {text} | worst {tbps:.2f} TB/s ({share:.0f}%) at {m}×{n}"
                         f"{_same_size_copy(result, mode, m, n, copy)} | {'✓' if share >= 100 * frac else '✗'} |")
    ties = {(t["mode"], t["m"], t["n"], t["peer"]): t for t in result.get("ties", ()) if t["ours_name"] == main}
    for mode in ("fwd", "bwd", "fwd+bwd"):
        items = [(b, ties.get((mode, b["m"], b["n"], b["peer"]))) for b in behind(result, mode)]  # re-run vs that peer
        texts = [f"{b['m']}×{b['n']} ({label(b['peer'])} {b['peer_tbps']:.2f} vs {b['tbps']:.2f}, {b['gap']:+.1f}%"
                 f"{_paired(tie)})" for b, tie in items]
        verdicts = [tie["verdict"] for _, tie in items if tie]
        paired = (f" (paired again: {verdicts.count('behind')} behind, {verdicts.count('level')} level, "
                  f"{verdicts.count('ahead')} ahead)" if verdicts else "")
        lines.append(f"| {mode}: at least the best peer at every shape | behind at {len(items)}/{len(shapes)}{paired}"
                     f"{': ' + '; '.join(texts[:4]) + ('…' if len(texts) > 4 else '') if texts else ''} | "
                     f"{'✗' if items else '✓'} |")
    for p in TORCH_OURS:
        ratios = [x for r in rows if r.get("small") and r["provider"] == p and "us" in r
                  for x in [_x_torch(r, idx.get(("torch_native", r["mode"], r["m"], r["n"], True)))] if x is not None]
        if ratios:
            lines.append(f"| {label(p)}: small call ≤ {SMALL_CALL_RATIO:g}× torch F.rms_norm | {min(ratios):.1f}× – "
                         f"{max(ratios):.1f}× | {'✓' if max(ratios) <= SMALL_CALL_RATIO else '✗'} |")
    return lines


def judged(rows: list[dict]) -> str:
    """The provider the targets judge: ``auto`` (impl=None), or ``pallas`` in runs made before it existed."""
    return "auto" if any(r["provider"] == "auto" for r in rows) else "pallas"


def behind(result: dict, mode: str, main: str | None = None) -> list[dict]:
    """The shapes where ``main`` (default: the judged provider, ``judged``) trails the run's best peer in ``mode``:
    each ``dict(mode, m, n, peer, peer_tbps, tbps, gap)``, ``gap`` in % (two decimals of TB/s hide ties)."""
    idx, rows = index(result["rows"]), result["rows"]
    provs = ordered(r["provider"] for r in rows)
    main = main or judged(rows)
    out = []
    for m, n in _shapes(rows):
        ours, peer = idx.get((main, mode, m, n, False), {}), best_peer(idx, provs, mode, m, n)
        if "tbps" in ours and peer and ours["tbps"] < peer[1]:
            out.append(dict(mode=mode, m=m, n=n, peer=peer[0], peer_tbps=peer[1], tbps=ours["tbps"],
                            gap=100 * (ours["tbps"] / peer[1] - 1)))
    return out


def _paired(tie: dict | None) -> str:
    """``"; paired over R rounds −g%, level"``: ``bench ties``' re-run of the shape against the same peer, if any."""
    if tie is None:
        return ""
    return f"; paired over {len(tie['ours'])} rounds {tie['gap']:+.1f}%, {tie['verdict']}"


def _same_size_copy(result: dict, mode: str, m: int, n: int, copy: float) -> str:
    """``"; a copy of its bytes T (P%)"``: what a torch ``copy_`` moving the ``mode``'s bytes at ``(m, n)`` reaches
    (``bench ceiling``'s rows, which ``render`` attaches as ``result["ceiling"]``; a call of tens of MB pays fixed
    costs a 2 GiB copy hides), as a share of the run's copy; "" where the run has no such row."""
    for row in result.get("ceiling", ()):
        tbps = row.get(f"copy_{mode}") if (row["m"], row["n"]) == (m, n) else None
        if tbps is not None:
            return f"; a copy of its bytes {tbps:.2f} ({100 * tbps / copy:.0f}%)"
    return ""


def _x_torch(row: dict, torch_row: dict | None) -> float | None:
    """A small call's time over torch F.rms_norm's: paired by round when the run has it (``x_torch``), else the
    ratio of the two medians (runs before the small calls took turns); None without a torch row."""
    if "x_torch" in row:
        return row["x_torch"]
    return row["us"] / torch_row["us"] if torch_row is not None and "us" in torch_row else None


def csv_text(result: dict) -> str:
    env, copy = result["env"], result["env"]["copy_tbps"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=ENV_KEYS + CSV_KEYS, extrasaction="ignore")
    writer.writeheader()
    for r in result["rows"]:
        writer.writerow({**env, **r, "pct_copy": pct(r, copy)})
    return buf.getvalue()


def plot(result: dict, path: pathlib.Path) -> None:
    """TB/s against N per provider, one panel per mode and M (long rows, M·N fixed, on the last row), the copy
    bandwidth as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    env, rows = result["env"], [r for r in result["rows"] if "tbps" in r and not r.get("small")]
    groups = sorted({r["m"] for r in rows if r["n"] <= 16384})
    panels = [(f"M={m}", lambda r, m=m: r["m"] == m and r["n"] <= 16384) for m in groups]
    if any(r["n"] > 16384 for r in rows):
        panels.append(("long rows", lambda r: r["n"] > 16384))
    fig, axes = plt.subplots(len(panels), 3, figsize=(16, 4.5 * len(panels)), squeeze=False, sharey=True)
    for i, (title, keep) in enumerate(panels):
        for j, mode in enumerate(("fwd", "bwd", "fwd+bwd")):
            ax = axes[i][j]
            for p in ordered(r["provider"] for r in rows):
                pts = sorted((r["n"], r["tbps"]) for r in rows if r["provider"] == p and r["mode"] == mode and keep(r))
                if pts:
                    ax.plot(*zip(*pts), marker="o", lw=2.2 if p in OURS else 1.2, label=label(p))
            ax.axhline(env["copy_tbps"], color="k", ls="--", lw=1, label=f"copy {env['copy_tbps']:.2f} TB/s")
            ax.set_xscale("log", base=2)
            ax.set(title=f"{mode}, {title}", xlabel="N (hidden size)", ylabel="TB/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"RMSNorm on {env['gpu']}, {env['dtype']}, casting={env['casting']} ({env['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: dict, out_dir: pathlib.Path, stem: str) -> list[pathlib.Path]:
    """``stem``.md and .csv, and the .png plot when the run has shapes to plot (not a ``--small-only`` run)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.md", out_dir / f"{stem}.csv"]
    paths[0].write_text(markdown(result))
    paths[1].write_text(csv_text(result))
    if any("tbps" in r and not r.get("small") for r in result["rows"]):
        paths.append(out_dir / f"{stem}.png")
        plot(result, paths[2])
    return paths


def save_table(result: dict, out: str | pathlib.Path, prefix: str, render) -> str:
    """A tool's run as ``<prefix>_<gpu>.json`` and ``.md`` (``render(result)``) under ``out``; returns the Markdown
    (the tools print it)."""
    from bench.timing import gpu_slug

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{prefix}_{gpu_slug(result['env']['gpu'])}"
    text = render(result)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(text)
    return text
