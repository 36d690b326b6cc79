"""``python -m bench``: every RMSNorm provider side by side on the GPU; table, CSV and plot in bench/results/.

    python -m bench [--dtype bfloat16|float16|float32] [--casting llama|gemma] [--quick] [--shapes 32768x4096,...]
                    [--no-small] [--out bench/results]
    python -m bench render RUN.json [RUN.json ...] [--out DIR]   # re-render (or merge) saved runs

Without a CUDA GPU it says so and exits 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from bench import report


def _stem(env: dict) -> str:
    gpu = env["gpu"].lower().replace("nvidia ", "").split()[0]
    return f"bench_{gpu}_{env['dtype']}_{env['casting']}"


def render(paths: list[str], out: pathlib.Path) -> list[pathlib.Path]:
    """Merge saved runs (same GPU, dtype, casting; each row keeps its own run's % of copy) and write them."""
    runs = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    env = dict(runs[0]["env"])
    env["copy_tbps"] = max(r["env"]["copy_tbps"] for r in runs)
    if len(runs) > 1:
        env["copy_note"] = ", ".join(f"{r['env']['copy_tbps']:.2f}" for r in runs)
    merged = dict(env=env, rows=[row for r in runs for row in r["rows"]])
    return report.write(merged, out, _stem(env))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["render"]:
        p = argparse.ArgumentParser(prog="python -m bench render")
        p.add_argument("runs", nargs="+")
        p.add_argument("--out", default="bench/results")
        args = p.parse_args(argv[1:])
        print("\n".join(map(str, render(args.runs, pathlib.Path(args.out)))))
        return 0
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--casting", default="llama", choices=["llama", "gemma", "none"])
    p.add_argument("--quick", action="store_true", help="four shapes instead of the full grid")
    p.add_argument("--shapes", default=None, help="comma-separated MxN (overrides --quick)")
    p.add_argument("--no-small", action="store_true", help="skip the small-call latency table")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("python -m bench: no CUDA GPU here; the benchmark only measures on a GPU. Nothing to do.")
        return 0
    from bench import suite
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes
              else suite.QUICK_SHAPES if args.quick else suite.SHAPES)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"run_{args.dtype}_{args.casting}.json"
    save = lambda result: partial.write_text(json.dumps(result))  # noqa: E731  (partial results survive a kill)
    result = suite.run(shapes, args.dtype, args.casting, small=not args.no_small, on_row=save)
    save(result)
    paths = report.write(result, out, _stem(result["env"]))
    print(report.markdown(result))
    print("wrote", ", ".join(map(str, paths + [partial])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
