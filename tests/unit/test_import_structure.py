"""The package structure: no import cycles between megatron's modules, the import paths users'
scripts rely on, and no module left at a path it moved from.

The cycle check reads every module's source (AST), so it sees imports anywhere in a file,
inside functions too: a function-level import that closes a circle is still a circle, only a
later one. Edges go from a module to the module an import names:
- ``import a.b.c`` and ``from a.b import c`` (c a module): a.b.c;
- ``from a.b import name`` where a/b/__init__.py binds ``name`` by importing it: the module
  that defines it (followed through re-exports), since that is what the import needs loaded;
- anything else: the longest prefix that is a module of ours (``from a.b import name``: a.b).
A submodule's implicit import of its package's ``__init__`` is not an edge: a package's
``__init__`` importing its own submodules is a cycle only when one of them imports back
through the ``__init__`` (``import a.b`` or a name the ``__init__`` defines itself).
"""
import ast
import importlib
import importlib.util
import inspect
import os
import re
import types
from typing import Dict, List, Optional, Set

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _modules(top: str, root: str) -> Dict[str, str]:
    """Dotted name -> file of every module under root/top (packages by their __init__.py)."""
    found = {}
    for directory, dirs, files in os.walk(os.path.join(root, top)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                found[dotted[:-len(".__init__")] if name == "__init__.py" else dotted] = path
    return found


class ImportGraph:
    def __init__(self, top: str = "megatron", root: str = ROOT):
        self.modules = _modules(top, root)
        self.trees = {name: ast.parse(_read(path), path)
                      for name, path in self.modules.items()}
        self.edges: Dict[str, Set[str]] = {name: set() for name in self.modules}
        for name in self.modules:
            for target in self._imports_of(name):
                if target is not None and target != name:
                    self.edges[name].add(target)

    def _is_package(self, name: str) -> bool:
        return self.modules[name].endswith("__init__.py")

    def _module_of(self, dotted: str) -> Optional[str]:
        """The longest prefix of ``dotted`` that is one of our modules (None: not ours)."""
        while dotted and dotted not in self.modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def _absolute(self, importer: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = importer if self._is_package(importer) else importer.rpartition(".")[0]
        parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def _defining_module(self, base: str, name: str, seen=()) -> Optional[str]:
        """The module that ``from base import name`` needs: base.name if a module, else the
        one base's __init__ imported ``name`` from (recursively), else base itself."""
        if f"{base}.{name}" in self.modules:
            return f"{base}.{name}"
        if base in self.modules and self._is_package(base) and base not in seen:
            for node in self.trees[base].body:  # re-exports are top-level imports
                if isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        if (alias.asname or alias.name) == name:
                            source = self._absolute(base, node)
                            if self._module_of(source) is not None:
                                return self._defining_module(source, alias.name,
                                                             seen + (base,))
        return self._module_of(base)

    def _imports_of(self, name: str):
        for node in ast.walk(self.trees[name]):  # every statement, function bodies too
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield self._module_of(alias.name)
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(name, node)
                for alias in node.names:
                    yield self._defining_module(base, alias.name)

    def cycles(self) -> List[List[str]]:
        """One shortest cycle (a -> ... -> a) per strongly connected component of 2+ modules."""
        return [self._shortest_cycle(component) for component in self._components()]

    def _components(self) -> List[Set[str]]:
        index, low, stack, on_stack, components = {}, {}, [], set(), []
        for root in sorted(self.edges):  # Tarjan, iterative (no recursion limit)
            if root in index:
                continue
            work = [(root, iter(sorted(self.edges[root])))]
            index[root] = low[root] = len(index)
            stack.append(root)
            on_stack.add(root)
            while work:
                node, children = work[-1]
                child = next(children, None)
                if child is not None:
                    if child not in index:
                        index[child] = low[child] = len(index)
                        stack.append(child)
                        on_stack.add(child)
                        work.append((child, iter(sorted(self.edges[child]))))
                    elif child in on_stack:
                        low[node] = min(low[node], index[child])
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
        return components

    def _shortest_cycle(self, component: Set[str]) -> List[str]:
        best: List[str] = []
        for start in sorted(component):  # breadth first: the first way back is the shortest
            paths, frontier = {start: [start]}, [start]
            while frontier and not (best and len(paths[frontier[0]]) >= len(best)):
                following = []
                for node in frontier:
                    for child in sorted(self.edges[node] & component):
                        if child == start and (not best or len(paths[node]) + 1 < len(best)):
                            best = paths[node] + [start]
                        elif child not in paths:
                            paths[child] = paths[node] + [child]
                            following.append(child)
                frontier = following
        return best


def test_the_graph_sees_function_level_imports_and_re_exports():
    edges = ImportGraph().edges
    assert "megatron.core.expert_parallel_state" in edges["megatron.core.parallel_state"]
    # parse_args, imported from the package, is defined in arguments/parse.py
    assert "megatron.training.arguments.parse" in edges["megatron.training.checkpoint_model"]
    # imported inside a function (W&B only when asked for)
    assert "megatron.training.logging.wandb_log" in \
        edges["megatron.training.logging.training_log"]


def test_no_import_cycles_between_megatron_modules():
    cycles = ImportGraph().cycles()
    assert not cycles, "import cycles (each a shortest loop through its modules):\n" + \
        "\n".join("  " + " -> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The check itself: a function-level import back is a cycle; an __init__ importing its
    submodules is not, unless one of them imports a name the __init__ defines."""
    package = tmp_path / "megatron" / "pkg"
    package.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("from megatron.pkg.a import A\nLOCAL = 1\n")
    (package / "a.py").write_text("A = 1\ndef f():\n    from megatron.pkg import b\n")
    (package / "b.py").write_text("from megatron.pkg import A\n")
    (package / "c.py").write_text("import megatron.pkg.d\n")
    (package / "d.py").write_text("def g():\n    from megatron.pkg.c import x\n")
    (package / "e.py").write_text("from megatron.pkg import LOCAL\n")
    graph = ImportGraph(root=str(tmp_path))
    assert graph.edges["megatron.pkg.b"] == {"megatron.pkg.a"}  # A, through the __init__
    assert graph.edges["megatron.pkg.e"] == {"megatron.pkg"}  # defined in the __init__
    found = sorted(sorted(set(cycle)) for cycle in graph.cycles())
    assert found == [["megatron.pkg.a", "megatron.pkg.b"], ["megatron.pkg.c", "megatron.pkg.d"]]


# The loop's own modules: the packages under megatron/training build on training_config only.
LOOP = {"megatron.training.pretrain", "megatron.training.training", "megatron.training.initialize",
        "megatron.training.gpt_step", "megatron.training.checkpoint_model"}


def test_the_package_map_rules():
    """docs/architecture.md "Package map": megatron/core never imports megatron/training, and
    no package under megatron/training imports the loop's own modules."""
    graph = ImportGraph()
    broken = []
    for module, targets in sorted(graph.edges.items()):
        in_subpackage = module.startswith("megatron.training.") and (
            graph._is_package(module) or module.count(".") > 2)
        for target in sorted(targets):
            if module.startswith("megatron.core") and target.startswith("megatron.training"):
                broken.append(f"{module} -> {target} (core imports training)")
            if in_subpackage and target in LOOP:
                broken.append(f"{module} -> {target} (a training package imports the loop)")
    assert not broken, "\n".join(broken)


# --- public import paths ----------------------------------------------------------------------

# What users' scripts import (Megatron's names), beside what the entry scripts import (below).
PUBLIC = {
    "megatron.core": ["parallel_state", "tensor_parallel"],
    "megatron.core.parallel_state": ["initialize_model_parallel", "destroy_model_parallel",
                                     "get_tensor_model_parallel_rank",
                                     "get_data_parallel_group",
                                     "initialize_expert_parallel",
                                     # answered from expert_parallel_state (module __getattr__)
                                     "get_expert_model_parallel_group",
                                     "get_expert_model_parallel_world_size",
                                     "get_expert_tensor_parallel_group",
                                     "get_expert_data_parallel_group",
                                     "expert_parallel_is_initialized"],
    "megatron.core.pipeline_parallel": ["get_forward_backward_func", "build_model_chunks"],
    "megatron.core.models": ["GPTModel", "LlamaModel", "llama_config"],
    "megatron.core.transformer": ["TransformerConfig"],
    "megatron.core.transformer.moe": ["MoEConfig", "MoELayer"],
    "megatron.core.transformer.context_parallel": ["context_parallel_attention",
                                                   "shard_sequence"],
    "megatron.core.distributed": ["DistributedDataParallel", "DistributedDataParallelConfig"],
    "megatron.core.optimizer": ["OptimizerConfig", "get_megatron_optimizer"],
    "megatron.core.enums": ["ModelType"],
    "megatron.training.arguments": ["parse_args", "validate_args", "build_configs",
                                    "get_parser", "NOOP_FLAGS", "ConfigError",
                                    "MegatronConfigs", "TrainingConfig"],
    "megatron.training.pretrain": ["pretrain"],
    "megatron.training.initialize": ["initialize_megatron"],
    "megatron.training.training": ["build_model", "train_step"],
    "megatron.training.checkpointing": ["save_checkpoint", "load_checkpoint",
                                        "CheckpointError"],
    "megatron.training.tokenizer": ["build_tokenizer"],
    "megatron.training.memory.estimate": ["estimate_memory", "format_report"],
    "megatron.training.planner": ["plan", "workload_from_flags"],
}


def _entry_script_imports():
    """(module, name) of every ``from megatron... import`` in pretrain_gpt.py/pretrain_llama.py."""
    found = []
    for script in ("pretrain_gpt.py", "pretrain_llama.py"):
        tree = ast.parse(_read(os.path.join(ROOT, script)))
        found += [(node.module, alias.name) for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron")
                  for alias in node.names]
    assert found
    return found


@pytest.mark.parametrize("module, name", sorted(
    {(m, n) for m, names in PUBLIC.items() for n in names} | set(_entry_script_imports())))
def test_public_import_path(module, name):
    exec(f"from {module} import {name}", {})


def test_public_paths_are_what_users_expect():
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.pretrain import pretrain

    assert isinstance(parallel_state, types.ModuleType)
    assert isinstance(tensor_parallel, types.ModuleType)
    assert callable(get_forward_backward_func)
    assert list(inspect.signature(pretrain).parameters)[:4] == [
        "train_valid_test_datasets_provider", "model_provider", "model_type",
        "forward_step_func"]  # Megatron's signature
    # `from megatron.training import pretrain` is the module (tests patch its globals): the
    # function is one attribute further, not shadowing the submodule of the same name.
    from megatron.training import pretrain as pretrain_module
    assert pretrain_module.pretrain is pretrain
    assert parallel_state.get_expert_model_parallel_group.__module__ == \
        "megatron.core.expert_parallel_state"
    with pytest.raises(AttributeError):
        parallel_state.get_expert_no_such_group  # noqa: B018


def test_every_megatron_path_the_docs_name_exists():
    """README.md and docs/architecture.md name files and folders by path: each must exist."""
    missing = []
    for doc in ("README.md", os.path.join("docs", "architecture.md"), "BENCHMARKS.md"):
        text = _read(os.path.join(ROOT, doc))
        for path in sorted(set(re.findall(r"\bmegatron/[\w/]*\w(?:\.py)?/?", text))):
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{doc}: {path}")
    assert not missing, "\n".join(missing)


# --- old paths --------------------------------------------------------------------------------

# Modules moved into packages; nothing may be left (no shim) at the old path.
MOVED = {
    "megatron.training.flag_definitions": "megatron.training.arguments.definitions",
    "megatron.training.flag_ranges": "megatron.training.arguments.ranges",
    "megatron.training.configs_from_args": "megatron.training.arguments.configs",
    "megatron.training.moe_flags": "megatron.training.arguments.moe",
    "megatron.training.theoretical_memory": "megatron.training.memory.estimate",
    "megatron.training.memory_params": "megatron.training.memory.params",
    "megatron.training.memory_activations": "megatron.training.memory.activations",
    "megatron.training.memory_schedules": "megatron.training.memory.schedules",
    "megatron.training.memory_modes": "megatron.training.memory.modes",
    "megatron.training.memory_moe": "megatron.training.memory.moe",
    "megatron.training.training_log": "megatron.training.logging.training_log",
    "megatron.training.wandb_log": "megatron.training.logging.wandb_log",
    "megatron.training.timers": "megatron.training.logging.timers",
    "megatron.training.moe_metrics": "megatron.training.logging.moe_metrics",
    "megatron.training.flops": "megatron.training.logging.flops",
    "megatron.training.pipeline_tracing": "megatron.training.logging.pipeline_tracing",
    "megatron.training.pipeline_timeline": "megatron.training.logging.pipeline_timeline",
    "megatron.training.token_guard": "megatron.training.guards.token_guard",
    "megatron.training.nan_guard": "megatron.training.guards.nan_guard",
    "megatron.training.fault_injection": "megatron.training.guards.fault_injection",
    "megatron.training.exit_signal": "megatron.training.guards.exit_signal",
    "megatron.training.errors": "megatron.training.guards.errors",
    "megatron.training.batch": "megatron.training.data.batch",
    "megatron.training.data_samplers": "megatron.training.data.samplers",
    "megatron.core.transformer.cp_all_gather":
        "megatron.core.transformer.context_parallel.all_gather",
    "megatron.core.transformer.cp_ring": "megatron.core.transformer.context_parallel.ring",
    "megatron.core.transformer.cp_blocks": "megatron.core.transformer.context_parallel.blocks",
    "megatron.core.transformer.attention_dropout_hash":
        "megatron.core.transformer.context_parallel.dropout_hash",
}


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_moved_module_only_at_its_new_path(old, new):
    assert importlib.util.find_spec(old) is None, f"{old} still importable (moved to {new})"
    assert importlib.import_module(new).__name__ == new


def test_entry_points_start_without_torchs_compiler_and_dtensor():
    """Importing a training entry point loads neither torch._dynamo (torch's varlen attention
    imports it) nor torch.distributed.tensor (FSDP2's DTensor): about 2 s of every process
    start together, paid by every rank of every launch. Only a CUDA varlen call and FSDP2
    itself load them."""
    import subprocess
    import sys

    probe = ("import sys, pretrain_llama, pretrain_gpt; "
             "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.tensor', "
             "'torch.distributed.fsdp') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
