"""Real data for end-to-end runs, made once per session the way a user makes it: the quickstart
corpus generator and its tokenizer, then tools/preprocess_data.py."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron.core.datasets.tokenizer_sidecar import SIDECAR_SUFFIX
from tests.e2e.runner import ROOT, load_tool
from tests.shared_fixture import once_per_run


@pytest.fixture(scope="session")
@once_per_run  # read only: the pytest workers share one copy
def quickstart_data(tmp_path_factory):
    """A byte-level BPE tokenizer directory and three Megatron datasets ``{data}/D1..D3``
    (.bin/.idx), each from a quickstart corpus with its own seed."""
    corpus = load_tool("make_quickstart_corpus")
    root = tmp_path_factory.mktemp("quickstart")
    stats = corpus.make(str(root), num_docs=300, seed=1, vocab_size=512)
    data = root / "data"
    data.mkdir()
    names = ("D1", "D2", "D3")
    # One line holds one document per dataset: one preprocess_data.py run writes all three.
    columns = [corpus.generate_documents(300, seed) for seed in range(1, len(names) + 1)]
    with open(root / "datasets.jsonl", "w") as f:
        f.writelines(json.dumps(dict(zip(names, docs))) + "\n" for docs in zip(*columns))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
         "--input", str(root / "datasets.jsonl"), "--output-prefix", str(data / "corpus"),
         "--json-keys", *names, "--tokenizer-type", "PretrainedFromHF",
         "--tokenizer-name-or-path", stats["tokenizer"], "--append-eod"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in names:  # Megatron launch lines name datasets without the suffix
        for ext in (".bin", ".idx", SIDECAR_SUFFIX):
            os.replace(data / f"corpus_{name}_document{ext}", data / f"{name}{ext}")
    return SimpleNamespace(root=root, data=str(data), tokenizer=stats["tokenizer"],
                           vocab_size=stats["vocab_size"])
