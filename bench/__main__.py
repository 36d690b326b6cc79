"""``python -m bench``: our kernels and every peer side by side on the GPU; results in bench/results/.

    python -m bench [suite] [--dtype D] [--casting C] [--quick] [--shapes MxN,...] [--providers a,b]
                            [--modes m,...] [--no-small | --small-only] [--out DIR]
    python -m bench sweep [--dtype D] [--casting C] [--quick] [--shapes MxN,...] [--kernels k,...]
                          [--modes both|fwd|bwd] [--bands-only] [--carveout PCT] [--out DIR]
    python -m bench overhead [--calls N] [--out DIR]
    python -m bench step [--profile | --trace] [--out DIR]   # --trace: Chrome traces + where the GPU idles
    python -m bench fused [--quick] [--out DIR]
    python -m bench carveout [--out DIR]   # one Triton-lowered binary launched by XLA and by torch
    python -m bench ceiling [--out DIR]    # a copy of each shape's bytes beside impl=None's kernels
    python -m bench contention [--out DIR] # the band kernels alone and beside other streams' kernels
    python -m bench ties [--dtype D] [--casting C] [--rounds R] [--ours a,b] [--out DIR]  # where ours trail
    python -m bench kernels --providers a,b --shapes MxN,... [--dtype D] [--casting C] [--modes m,...] [--out DIR]
    python -m bench render RUN.json [RUN.json ...] [--out DIR]    # re-render (or merge) saved suite runs
    python -m bench summary [--write README.md | --check README.md]   # the README's table, from bench/results

suite: every provider × fwd / bwd / fwd+bwd × shapes, copy ceiling, memory, small calls, the targets (table, CSV,
PNG, raw JSON). sweep: our kernels under alternative tilings. overhead: the torch bridge's small- and
large-call cost, layer by layer, and which providers a CUDA graph can capture. step: one training step of HF Llama
and Gemma2 stacks, norms by provider (and with the residual add fused). fused: the fused residual add + norm
against Liger's and the unfused add, and per-head (q/k) norms. carveout: what XLA's launch (the most shared
memory, the least L1) costs the same binary. ceiling: what a copy of the same bytes reaches at each shape
(the suite divides by a 2 GiB copy). contention: the column-band kernels (whose row groups must be co-resident)
alone and beside other streams' kernels. ties: ours and the best peer again, taking turns over rounds, at each
shape where the committed suite run has ours behind (the targets quote it). kernels: each kernel's µs of the
providers asked, timed as the suite times them. summary: the README's speed table from
the committed results. Files are named by the GPU they ran on. Measuring without a CUDA GPU (or without torch) says
so and exits 2; ``render`` and ``summary`` run anywhere.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from bench import report, timing

COMMANDS = ("suite", "sweep", "overhead", "step", "fused", "carveout", "ceiling", "contention", "ties", "kernels",
            "render", "summary")


def suite_stem(env: dict) -> str:
    return f"bench_{timing.gpu_slug(env['gpu'])}_{env['dtype']}_{env['casting']}"


def ties_stem(env: dict) -> str:
    """``bench ties``' file name for the suite table of ``env`` (GPU, dtype, casting)."""
    return f"ties_{timing.gpu_slug(env['gpu'])}_{env['dtype']}_{env['casting']}"


def render(paths: list[str], out: pathlib.Path) -> list[pathlib.Path]:
    """Merge saved suite runs (same GPU, dtype, casting; each row keeps its own run's % of copy; a row measured
    again in a later run replaces the earlier one) and write them (with the merged JSON when there are several).
    The targets quote a same-size copy from ``ceiling_<gpu>.json`` in ``out`` where there is one (``bench
    ceiling``) and the paired re-runs from ``ties_<gpu>_<dtype>_<casting>.json`` (``bench ties``)."""
    runs = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    env = dict(runs[0]["env"])
    env["copy_tbps"] = max(r["env"]["copy_tbps"] for r in runs)
    if len(runs) > 1:
        env["copy_note"] = ", ".join(r["env"].get("copy_note") or f"{r['env']['copy_tbps']:.2f}" for r in runs)
    rows = {}  # a later run's row replaces an earlier one's (same provider, mode, shape, small or not)
    for run in runs:
        for row in run["rows"]:  # a torch row of a run timed by CUDA events keeps that mark (report.event_timed)
            tag = {"timer": "events"} if "tbps" in row and report.event_timed(row, run["env"]) else {}
            rows[row["provider"], row["mode"], row["m"], row["n"], bool(row.get("small"))] = {**row, **tag}
    env["timer"] = report.KERNEL_TIMER  # rows timed otherwise are tagged
    merged = dict(env=env, rows=list(rows.values()))
    ceiling = out / f"ceiling_{timing.gpu_slug(env['gpu'])}.json"  # `bench ceiling`'s run on that GPU, if any
    extra = dict(ceiling=json.loads(ceiling.read_text())["rows"]) if ceiling.exists() else {}
    ties = out / f"{ties_stem(env)}.json"  # `bench ties`' re-run of this table's gaps
    if ties.exists():
        extra["ties"] = json.loads(ties.read_text())["rows"]
    paths = report.write({**merged, **extra}, out, suite_stem(env))
    if len(runs) > 1:  # the merged raw rows too, so the files re-render from what they show
        paths.append(out / f"{suite_stem(env)}.json")
        paths[-1].write_text(json.dumps(merged, indent=1))
    return paths


def _write(module, result: dict, stem: pathlib.Path) -> int:
    """``stem``.json (raw), .md (``module.markdown``) and .png (``module.plot``, when it has one); prints the table."""
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = module.markdown(result)
    stem.with_suffix(".md").write_text(text)
    if hasattr(module, "plot"):
        module.plot(result, stem.with_suffix(".png"))
    print(text)
    return 0


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(text.split(","))
    if set(modes) - set(timing.MODES):
        raise argparse.ArgumentTypeError(f"modes are comma-separated fwd, bwd, fwd+bwd; got {text!r}")
    return modes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name in ("suite", "sweep"):
        s = sub.add_parser(name)
        s.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
        s.add_argument("--casting", default="llama", choices=["llama", "gemma", "none"])
        s.add_argument("--quick", action="store_true", help="a few shapes (and configs) instead of the full grid")
        s.add_argument("--shapes", type=timing.parse_shapes, default=None,
                       help="comma-separated MxN (overrides --quick)")
        s.add_argument("--out", default="bench/results")
        if name == "sweep":
            s.add_argument("--kernels", type=lambda t: tuple(t.split(",")), default=None,
                           help="comma-separated: pallas (Triton lowering), mosaic, triton (default: all)")
            s.add_argument("--modes", default="both", choices=["both", "fwd", "bwd"], help="directions swept")
            s.add_argument("--bands-only", action="store_true",
                           help="Pallas (Triton lowering): the heuristic's config, the band heuristic's and the band "
                                "candidates (one-warp, carried) alone")
            s.add_argument("--carveout", type=int, default=None, metavar="PCT",
                           help="also time the Pallas (Triton lowering) kernels at this shared-memory carveout "
                                "(100: XLA's launch)")
        if name == "suite":
            small = s.add_mutually_exclusive_group()
            small.add_argument("--no-small", action="store_true", help="skip the small-call latency table")
            small.add_argument("--small-only", action="store_true",
                               help="only the small-call table (merge it into a full run with `render`)")
            s.add_argument("--providers", type=lambda t: tuple(t.split(",")), default=None,
                           help="comma-separated provider names (default: all; merge runs with `render`)")
            s.add_argument("--modes", type=_modes, default=timing.MODES,
                           help="comma-separated: fwd, bwd, fwd+bwd (default: all; merge runs with `render`)")
    o = sub.add_parser("overhead")
    o.add_argument("--calls", type=int, default=2000, help="back-to-back calls per timing loop (small call)")
    o.add_argument("--out", default="bench/results")
    st = sub.add_parser("step")
    st.add_argument("--profile", action="store_true", help="also GPU time per step in norm and add kernels")
    st.add_argument("--trace", action="store_true", help="only trace one Llama step (hf, pallas, "
                    "pallas+fused) to --out, and report where the GPU idles (bench.gaps)")
    st.add_argument("--out", default="bench/results")
    fu = sub.add_parser("fused")
    fu.add_argument("--quick", action="store_true", help="one shape per table")
    fu.add_argument("--out", default="bench/results")
    sub.add_parser("carveout").add_argument("--out", default="bench/results")
    sub.add_parser("ceiling").add_argument("--out", default="bench/results")
    sub.add_parser("contention").add_argument("--out", default="bench/results")
    t = sub.add_parser("ties")
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    t.add_argument("--casting", default="llama", choices=["llama", "gemma", "none"])
    t.add_argument("--rounds", type=int, default=None, help="rounds of turns (default: bench.ties.ROUNDS)")
    t.add_argument("--ours", type=lambda v: tuple(v.split(",")), default=None,
                   help="comma-separated providers of ours to pair (default: the one the targets judge, impl=None)")
    t.add_argument("--out", default="bench/results", help="where the suite run is read and the result written (an "
                   "existing result's rows of providers not re-run are kept)")
    k = sub.add_parser("kernels")
    k.add_argument("--providers", type=lambda v: tuple(v.split(",")), required=True,
                   help="comma-separated provider names (as the suite's)")
    k.add_argument("--shapes", type=timing.parse_shapes, required=True, help="comma-separated MxN")
    k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    k.add_argument("--casting", default="llama", choices=["llama", "gemma", "none"])
    k.add_argument("--modes", type=_modes, default=timing.MODES, help="comma-separated: fwd, bwd, fwd+bwd")
    k.add_argument("--out", default="bench/results")
    r = sub.add_parser("render")
    r.add_argument("runs", nargs="+")
    r.add_argument("--out", default="bench/results")
    s = sub.add_parser("summary")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="FILE", help="replace the summary block between the markers in FILE")
    g.add_argument("--check", metavar="FILE", help="exit 1 if FILE's block differs from the committed results'")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        argv = ["suite", *argv]
    args = parser().parse_args(argv)
    if args.command == "summary":
        from bench import summary

        block = summary.table()
        path = pathlib.Path(args.write or args.check or "")
        if args.write:
            path.write_text(summary.replace_block(path.read_text(), block))
        elif args.check:
            if summary.replace_block(path.read_text(), block) != path.read_text():
                print(f"python -m bench summary: {path}'s speed table differs from bench/results; run "
                      f"`python -m bench summary --write {path}`", file=sys.stderr)
                return 1
        else:
            print(block)
        return 0
    out = pathlib.Path(args.out)
    if args.command == "render":
        print("\n".join(map(str, render(args.runs, out))))
        return 0
    code = timing.gpu_or_exit_code(f"python -m bench {args.command}")
    if code is not None:
        return code
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "overhead":
        from bench import overhead

        result = overhead.run(args.calls)
        return _write(overhead, result, out / f"overhead_{timing.gpu_slug(result['env']['gpu'])}")
    if args.command == "step":
        from bench import step

        if args.trace:
            from bench import gaps

            paths = step.write_traces(out)
            env = timing.environment()
            text = gaps.report(paths, env)
            (out / f"step_trace_{timing.gpu_slug(env['gpu'])}.md").write_text(text)
            print(text + "\n".join(map(str, paths)))
            return 0
        result = step.run(profile=args.profile)
        return _write(step, result, out / f"step_{timing.gpu_slug(result['env']['gpu'])}")
    if args.command == "fused":
        from bench import fused

        result = fused.run(args.quick)
        return _write(fused, result, out / f"fused_{timing.gpu_slug(result['env']['gpu'])}")
    if args.command == "carveout":
        from bench import carveout

        result = carveout.run()
        return _write(carveout, result, out / f"carveout_{timing.gpu_slug(result['env']['gpu'])}")
    if args.command == "contention":
        from bench import contention

        result = contention.run()
        return _write(contention, result, out / f"contention_{timing.gpu_slug(result['env']['gpu'])}")
    if args.command == "ceiling":
        from bench import ceiling

        result = ceiling.run()
        return _write(ceiling, result, out / f"ceiling_{timing.gpu_slug(result['env']['gpu'])}")
    if args.command == "ties":
        import torch

        from bench import ties

        table = dict(gpu=torch.cuda.get_device_name(), dtype=args.dtype, casting=args.casting)
        suite_run = out / f"{suite_stem(table)}.json"
        if not suite_run.exists():
            print(f"python -m bench ties: no suite run {suite_run} to pair (run `python -m bench` first)",
                  file=sys.stderr)
            return 2
        result = ties.run(json.loads(suite_run.read_text()), args.rounds or ties.ROUNDS, args.ours)
        stem = out / ties_stem(table)
        earlier = stem.with_suffix(".json")  # other providers' rows in it are kept (ties.merge)
        result = ties.merge(json.loads(earlier.read_text()) if earlier.exists() else None, result)
        return _write(ties, result, stem)
    if args.command == "kernels":
        from bench import kernels

        result = kernels.run(args.shapes, args.dtype, args.casting, args.providers, args.modes)
        tag = "_".join(args.providers)
        return _write(kernels, result, out / f"kernels_{timing.gpu_slug(result['env']['gpu'])}_{args.dtype}_"
                                             f"{args.casting}_{tag}")
    if args.command == "sweep":
        from bench import sweep

        kernels = args.kernels or sweep.KERNELS
        unknown = set(kernels) - set(sweep.KERNELS)
        if unknown:
            print(f"python -m bench sweep: --kernels takes {', '.join(sweep.KERNELS)}, got {sorted(unknown)}",
                  file=sys.stderr)
            return 2
        modes = ("fwd", "bwd") if args.modes == "both" else (args.modes,)
        result = sweep.run(args.shapes or (sweep.QUICK_SHAPES if args.quick else sweep.SHAPES), args.dtype,
                           args.casting, args.quick, kernels, modes, args.bands_only, args.carveout)
        tag = ("" if args.kernels is None else "_" + "_".join(kernels)) + ("" if len(modes) == 2 else "_" + modes[0])
        tag += "_bands" * args.bands_only + ("" if args.carveout is None else f"_carveout{args.carveout}")
        return _write(sweep, result,
                      out / f"sweep_{timing.gpu_slug(result['env']['gpu'])}_{args.dtype}_{args.casting}{tag}")
    from bench import suite

    shapes = () if args.small_only else args.shapes or (suite.QUICK_SHAPES if args.quick else suite.SHAPES)
    partial = out / f"run_{args.dtype}_{args.casting}.json"
    save = lambda result: partial.write_text(json.dumps(result))  # noqa: E731  (partial results survive a kill)
    result = suite.run(shapes, args.dtype, args.casting, small=not args.no_small, on_row=save, only=args.providers,
                       modes=args.modes)
    save(result)
    paths = report.write(result, out, suite_stem(result["env"]))
    raw = out / f"{suite_stem(result['env'])}.json"
    partial.replace(raw)
    print(report.markdown(result))
    print("wrote", ", ".join(map(str, paths + [raw])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
