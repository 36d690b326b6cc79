"""Dependencies point one way: ``pallas_norm`` (JAX only) <- ``torch_bridge`` <- ``pallas_norm_tools``; no package
imports bench or test code; no import cycle; a JAX-only environment runs the core; only ``pallas_norm/compat.py``
touches JAX's private modules, and XLA or Triton users never reach it. Each check is shown to catch a violation.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import grimp

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_norm", "torch_bridge", "pallas_norm_tools")
HIDE_TORCH = ("import sys\nfor name in ('torch', 'triton', 'transformers', 'matplotlib'):\n"
              "    sys.modules[name] = None\n")  # a later `import torch` then raises ModuleNotFoundError


def run_python(code: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def lint_imports(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    """The import-linter contracts of pyproject.toml: layers, no PyTorch/HF in the core, no bench/test imports."""
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


def test_import_contracts_catch_an_upward_import(tmp_path):
    """The same kind of contract fails on a tiny project whose core imports its tools."""
    for pkg, body in (("core", "from tools import helper\n"), ("tools", "helper = 1\n")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text(body)
    (tmp_path / ".importlinter").write_text(textwrap.dedent("""\
        [importlinter]
        root_packages =
            core
            tools
        [importlinter:contract:layers]
        name = core <- tools
        type = layers
        layers =
            tools
            core
        """))
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "core <- tools BROKEN" in result.stdout, result.stdout


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph ``edges`` (as a path that ends where it starts), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_import_cycles():
    graph = grimp.build_graph(*PACKAGES)
    ours = {m for m in graph.modules if m.split(".")[0] in PACKAGES}
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i in ours} for m in ours}
    assert find_cycle(edges) is None, find_cycle(edges)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]  # it finds one


def test_jax_only_environment_runs_the_core():
    """With torch, triton, transformers and matplotlib unimportable: every core module imports, ``rms_norm``
    (Pallas interpreted and XLA) and ``nnx.RMSNorm`` run forward and backward; the base dependencies of the
    package name none of them."""
    modules = sorted(p.stem for p in (ROOT / "pallas_norm").glob("*.py") if p.stem not in ("__init__", "__main__"))
    result = run_python(HIDE_TORCH + textwrap.dedent(f"""
        import importlib, jax, jax.numpy as jnp
        from flax import nnx
        import pallas_norm as pn
        for m in {modules!r}:
            importlib.import_module("pallas_norm." + m)
        x, w = jnp.ones((3, 64), jnp.bfloat16), jnp.full((64,), 0.5)
        for impl in ("interpret", "xla"):
            g = jax.grad(lambda w: pn.rms_norm(x, w, impl=impl).astype(jnp.float32).sum())(w)
            assert g.shape == (64,)
        norm = pn.nnx.RMSNorm(64, rngs=nnx.Rngs(0), impl="interpret")
        assert norm(x).shape == x.shape
        assert not any(k.split(".")[0] in ("torch", "triton", "torch_bridge", "pallas_norm_tools")
                       for k, v in sys.modules.items() if v is not None)
        print("ok")
        """))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
    text = (ROOT / "pyproject.toml").read_text()
    base = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert all(name not in base for name in ("torch", "triton", "transformers", "matplotlib"))


def test_the_check_sees_a_hidden_module_imported():
    result = run_python(HIDE_TORCH + "import torch_bridge\n")
    assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr


def test_cli_names_the_missing_extra():
    result = run_python(HIDE_TORCH + "from pallas_norm_tools.cli import main\nsys.exit(main(['check']))\n")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "pallas-norm check needs torch, triton" in result.stderr
    assert "pip install 'pallas-norm[torch]'" in result.stderr


def test_torch_bridge_loads_no_tools_bench_or_tests():
    result = run_python("import sys, torch_bridge\n"
                        "print(sorted({k.split('.')[0] for k in sys.modules} & {'pallas_norm_tools', 'bench', "
                        "'helpers', 'conftest', 'transformers', 'matplotlib'}))")
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]


def test_private_jax_internals_stay_in_compat():
    """Only pallas_norm/compat.py names ``jax._src``, and XLA and Mosaic-interpreter (JAX) and Triton (torch) users
    never reach it; the launch route's reader does (the control: the same probe sees a use)."""
    mentions = [p.relative_to(ROOT) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
                if "jax._src" in p.read_text() and p.name != "compat.py"]
    assert mentions == []
    tree = ast.parse((ROOT / "pallas_norm" / "compat.py").read_text())
    module_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all("_src" not in ast.unparse(n) for n in module_level)  # imported lazily, inside functions
    result = run_python(textwrap.dedent("""
        import os; os.environ["TRITON_INTERPRET"] = "1"
        import jax, jax.numpy as jnp, torch
        import pallas_norm as pn, torch_bridge
        from pallas_norm import compat
        pn.rms_norm(jnp.ones((2, 8)), impl="xla")
        pn.rms_norm(jnp.ones((2, 128)), impl="mosaic_interpret")
        x = torch.ones(2, 8, requires_grad=True)
        torch_bridge.rms_norm(x, backend="triton").sum().backward()
        before = sorted(compat.touched())
        from torch_bridge import launch_route
        device = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "cuda")
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
            launch_route.forward_program(8, 64, torch.float32, None, 1e-6, 0.0, "llama")
        print(before, len(compat.touched()))
        """))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[0] == "[]" and int(result.stdout.split()[-1]) >= 1, result.stdout
