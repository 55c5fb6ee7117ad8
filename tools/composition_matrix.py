"""Which pairs of parallelism and memory features compose: every pair of the features below,
each alone on the diagonal, as the code decides it (the flag parser and build_configs, as
pretrain() checks them at start), written as a table into README.md and docs/architecture.md.

    python tools/composition_matrix.py           # print the table
    python tools/composition_matrix.py --write   # update README.md and docs/architecture.md
    python tools/composition_matrix.py --check   # exit 1 if they are stale

tests/e2e/test_composition_matrix.py runs every accepted pair (``cases()``) against one
process; tests/unit/test_composition_table.py checks the files hold ``render()``'s tables.
"""
import argparse
import contextlib
import io
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: the checkout's megatron, not an installed one
    sys.path.insert(0, ROOT)

# A tiny LLaMA, micro batch 1 and 8 sequences a step: 2 to 8 microbatches per DP rank, so every
# pipeline schedule has several in flight. --device cpu: the table must not depend on the
# machine that writes it (fp32 on CUDA would be refused for the math attention kernel).
# Adam's eps near the gradients' size (with lr 1e-2) makes a step feel the gradients' scale:
# at 1e-8 Adam divides a mis-scaled gradient out again and the losses would not show it.
BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 8 "
        "--train-iters 2 --lr 1e-2 --adam-eps 1e-2 --lr-decay-style constant --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 64 --log-interval 1 --eval-iters 0 "
        "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --device cpu "
        "--normalization RMSNorm --swiglu --ffn-hidden-size 48 --position-embedding-type rope "
        "--disable-bias-linear --untie-embeddings-and-output-weights").split()
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-grouped-gemm "
       "--moe-aux-loss-coeff 0.01").split()
# Mock data draws ids from the tokenizer's whole vocabulary, end-of-document (64) included:
# about two documents end in each step's 136 tokens.
PACKED = "--reset-position-ids --reset-attention-mask --eod-mask-loss".split()
# DeepSeek-V3's attention (both latents, YaRN) with one depth of multi-token prediction.
MLA_MTP = ("--multi-latent-attention --q-lora-rank 12 --kv-lora-rank 16 --qk-head-dim 8 "
           "--qk-pos-emb-head-dim 4 --v-head-dim 6 --rope-type yarn --rotary-scaling-factor 4 "
           "--original-max-position-embeddings 4 --mtp-num-layers 1").split()
# What a feature changes in the computation itself: its reference (one process) has it too.
# The order is the model's name: "dense", "moe+packed", "dense+fp8+muon"...
MODEL_PARTS = {
    "moe": MOE,
    "packed": PACKED,
    "fp8": "--fp8-format e4m3 --fp8-recipe tensorwise".split(),
    "muon": "--optimizer muon --muon-use-nesterov --muon-extra-scale-factor 0.2".split(),
    "mla+mtp": MLA_MTP,
    "window": "--window-size 5,0 --window-attn-skip-freq 2".split(),
}
SHARDED_OPTIMIZER = "--use-distributed-optimizer"


@dataclass(frozen=True)
class Feature:
    name: str
    flags: Tuple[str, ...]
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1  # the data-parallel size it needs to mean anything
    ep: int = 1
    model: str = ""  # a MODEL_PARTS key: the model (and reference) it needs
    shards_optimizer: bool = False  # it chooses how the optimizer state is sharded
    needs_sharding: bool = False  # it needs one of those (the distributed optimizer if none)
    note: str = ""


def _f(name, flags, **sizes):
    return Feature(name, tuple(flags.split()), **sizes)


FEATURES = (
    _f("TP+SP", "--tensor-model-parallel-size 2 --sequence-parallel", tp=2),
    _f("CP", "--context-parallel-size 2", cp=2),
    _f("PP 1F1B", "--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b", pp=2),
    _f("PP interleaved", "--pipeline-model-parallel-size 2 --pipeline-schedule interleaved "
       "--num-layers-per-virtual-pipeline-stage 1", pp=2),
    _f("PP ZB-H1", "--pipeline-model-parallel-size 2 --pipeline-schedule zb-h1", pp=2),
    _f("EP", "--expert-model-parallel-size 2", ep=2, model="moe"),
    _f("distributed optimizer", SHARDED_OPTIMIZER, dp=2, shards_optimizer=True),
    _f("ZeRO-2", f"{SHARDED_OPTIMIZER} --shard-gradients", dp=2, shards_optimizer=True),
    _f("FSDP2", "--use-torch-fsdp2", dp=2, shards_optimizer=True),
    _f("HSDP", "--num-distributed-optimizer-instances 2", dp=4, needs_sharding=True,
       note="2 replicas x 2 shards; with FSDP2 its 2-D mesh, else the distributed optimizer's"),
    _f("CPU offload", "--optimizer-cpu-offload", note="of the pair's optimizer, DDP's if none"),
    _f("recomputation", "--recompute-granularity full --recompute-method uniform "
       "--recompute-num-layers 1"),
    _f("packed documents", " ".join(PACKED), model="packed"),
    _f("overlapped distributed optimizer", f"{SHARDED_OPTIMIZER} --overlap-grad-reduce "
       "--overlap-param-gather --ddp-bucket-size 1000", dp=2, shards_optimizer=True,
       note="buckets of 1000 elements: several reductions and gathers in flight"),
    _f("FP8", " ".join(MODEL_PARTS["fp8"]), model="fp8", note="tensorwise"),
    _f("Muon", " ".join(MODEL_PARTS["muon"]), model="muon"),
    _f("MTP with MLA", " ".join(MLA_MTP), model="mla+mtp"),
    _f("sliding windows", " ".join(MODEL_PARTS["window"]), model="window"),
)
BY_NAME = {f.name: f for f in FEATURES}
# Beyond the pairs: triples whose three features meet on one code path that no pair reaches
# (each once trained wrong or crashed): the last stage's embedding copy read by multi-token
# prediction under the overlapped all-gather; the row-parallel reduce-scatter of FP8 GEMMs
# under FSDP2 with sequence parallelism.
TRIPLES = (("PP 1F1B", "overlapped distributed optimizer", "MTP with MLA"),
           ("TP+SP", "FSDP2", "FP8"))


@dataclass(frozen=True)
class Case:
    """One cell: the features, the flags beyond the model's, the number of ranks."""
    features: Tuple[str, ...]
    flags: Tuple[str, ...]
    world: int
    model: str  # "dense" or "moe", then its other MODEL_PARTS: "moe+packed", "dense+fp8"...

    @property
    def name(self) -> str:
        return " x ".join(self.features)

    def model_flags(self) -> List[str]:
        parts = self.model.split("+")
        return BASE + [f for part, flags in MODEL_PARTS.items()
                       if set(part.split("+")) <= set(parts) for f in flags]

    def reference(self) -> "Case":
        """One process of the same model: what this case must equal."""
        return Case((), (), 1, self.model)

    def run_key(self):
        """Equal for the same run: distributed optimizer x ZeRO-2 is ZeRO-2 alone."""
        return self.model, self.world, tuple(sorted(_options(self.argv())))

    def argv(self) -> List[str]:
        """The command line; a flag the model flags already hold is not repeated."""
        model = self.model_flags()
        return model + [t for flag, values in _options(self.flags) if flag not in model
                        for t in (flag, *values)]


def _options(flags) -> List[Tuple[str, Tuple[str, ...]]]:
    """[(flag, its values)] in order."""
    out = []
    for token in flags:
        if token.startswith("--"):
            out.append((token, ()))
        else:
            out[-1] = (out[-1][0], out[-1][1] + (token,))
    return out


def case_of(*names: str) -> Case:
    """The run of these features together; ValueError if two of them set one option to two
    values (two pipeline schedules: not a pair, one run has one)."""
    features = [BY_NAME[n] for n in dict.fromkeys(names)]
    merged: Dict[str, Tuple[str, ...]] = {}
    for flag, values in _options(f for feature in features for f in feature.flags):
        if merged.setdefault(flag, values) != values:
            raise ValueError(f"both set {flag}")
    if any(f.needs_sharding for f in features) and \
            not any(f.shards_optimizer for f in features):
        merged[SHARDED_OPTIMIZER] = ()
    tp, cp, pp = (max(getattr(f, size) for f in features) for size in ("tp", "cp", "pp"))
    ep = max(f.ep for f in features)
    dp = max([f.dp for f in features] + [-(-ep // cp)])  # EP cuts DP x CP
    models = {f.model for f in features}
    model = "+".join(["moe" if "moe" in models else "dense"] +
                     [part for part in MODEL_PARTS if part != "moe" and part in models])
    flags = tuple(t for flag, values in merged.items() for t in (flag, *values))
    return Case(tuple(f.name for f in features), flags, tp * cp * pp * dp, model)


def refusal(case: Case) -> Optional[str]:
    """None if the code accepts the case at start, else its one-line reason: what pretrain()
    checks before any process group exists (megatron/training/pretrain.py)."""
    from megatron.training.arguments import ConfigError, build_configs, parse_args
    from megatron.training.arguments.configs import check_training_microbatches

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):  # argparse prints its own errors, then exits
            args = parse_args(case.argv())
            build_configs(args, case.world)
            check_training_microbatches(args)
    except (ConfigError, ValueError) as exc:
        return " ".join(str(exc).split())
    except SystemExit:
        return " ".join(stderr.getvalue().strip().splitlines()[-1:]) or "argparse exited"
    return None


def cases() -> Dict[Tuple[str, str], object]:
    """Each unordered pair (a, a for a feature alone) -> its Case if accepted, else a str:
    the refusal, or "" when the two set one option twice (not a pair)."""
    out = {}
    for i, a in enumerate(FEATURES):
        for b in FEATURES[i:]:
            try:
                case = case_of(a.name, b.name)
            except ValueError:
                out[a.name, b.name] = ""
                continue
            reason = refusal(case)
            out[a.name, b.name] = case if reason is None else reason
    return out


def accepted_cases() -> List[Case]:
    """The pairs the code accepts, then TRIPLES (which it must accept)."""
    triples = [case_of(*names) for names in TRIPLES]
    for case in triples:
        reason = refusal(case)
        if reason is not None:
            raise ValueError(f"the triple {case.name} is refused at start: {reason}")
    return [c for c in cases().values() if isinstance(c, Case)] + triples


def render(detail: bool = True, matrix=None) -> str:
    """The markdown: the table (features as rows and columns by number), its footnotes, and
    with ``detail`` each feature's flags and ranks alone."""
    matrix = cases() if matrix is None else matrix
    notes: List[str] = []

    def cell(a, b):
        got = matrix.get((a, b), matrix.get((b, a)))
        if isinstance(got, Case):
            return "✓"
        if got == "":
            return "—"
        if got not in notes:
            notes.append(got)
        return f"✗{notes.index(got) + 1}"

    header = "| | " + " | ".join(str(i + 1) for i in range(len(FEATURES))) + " |"
    lines = [header, "|" + "---|" * (len(FEATURES) + 1)]
    for i, a in enumerate(FEATURES):
        lines.append(f"| {i + 1} {a.name} | "
                     + " | ".join(cell(a.name, b.name) for b in FEATURES) + " |")
    out = [_wrapped("Generated by `python tools/composition_matrix.py --write` from the "
                    "code's own start-up checks; tests/e2e/test_composition_matrix.py runs "
                    "each ✓ (2 iterations of a tiny model) against one process. ✓ composes "
                    "(the diagonal: the feature alone), ✗n is refused at start with footnote "
                    "n's message, — is not a pair (both set the same option)."), "", *lines, ""]
    out += [_wrapped(note, f"{n + 1}. ") for n, note in enumerate(notes)]
    out += ["", _wrapped("Also run against one process: " + "; ".join(
        " x ".join(names) for names in TRIPLES) + ".")]
    if detail:
        out += ["", _wrapped("Each run: a tiny LLaMA (4 layers, hidden 32), micro batch 1, 8 "
                             "sequences a step, 2 steps; EP runs on a 4-expert top-2 MoE of it. "
                             "A pair has both features' flags on TP x CP x PP x DP ranks, DP the "
                             "largest either needs:"), ""]
        for i, f in enumerate(FEATURES):
            case = case_of(f.name)
            ranks = f"{case.world} rank{'s' if case.world > 1 else ''} alone"
            out.append(_wrapped(f"{f.name}: `{' '.join(case.flags)}` ({ranks}"
                                + "".join(f"; {x}" for x in (f.note,) if x) + ")", f"{i + 1}. "))
    return "\n".join(out) + "\n"


def _wrapped(text: str, item: str = "") -> str:
    """Markdown prose at the docs' width; ``item``: a numbered list item's marker."""
    return textwrap.fill(item + text, 100, subsequent_indent=" " * len(item),
                         break_long_words=False, break_on_hyphens=False)


BEGIN, END = "<!-- composition-matrix:begin -->", "<!-- composition-matrix:end -->"
TARGETS = {"README.md": False, os.path.join("docs", "architecture.md"): True}  # file: detail


def updated(text: str, block: str, path: str) -> str:
    """``text`` with the block between the markers replaced by ``block``."""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers: add them where the table "
                         f"goes.")
    return pattern.sub(lambda _: f"{BEGIN}\n{block}{END}", text, count=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="update the files' tables")
    action.add_argument("--check", action="store_true", help="exit 1 if a table is stale")
    opts = parser.parse_args(argv)
    matrix = cases()
    if not (opts.write or opts.check):
        print(render(True, matrix), end="")
        return 0
    stale = []
    for path, detail in TARGETS.items():
        full = os.path.join(ROOT, path)
        with open(full, encoding="utf-8") as f:
            text = f.read()
        new = updated(text, render(detail, matrix), path)
        if new != text:
            stale.append(path)
            if opts.write:  # atomically: a reader never sees half a file
                with open(full + ".tmp", "w", encoding="utf-8") as f:
                    f.write(new)
                os.replace(full + ".tmp", full)
    if opts.check and stale:
        print(f"stale composition table in {', '.join(stale)}: run python "
              f"tools/composition_matrix.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
