"""The prefill leg's body: the prompt's KV once, one token, not streamed, whatever the client asked."""

from __future__ import annotations

from kvplane.proxy import bodies


def test_the_prefill_leg_computes_the_prompt_once_for_one_token_unstreamed() -> None:
    client = {"model": "m", "prompt": "hi", "n": 3, "max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 5,
              "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7}
    body = bodies.prefill_body(client, token="ab" * 16)
    assert body == {"model": "m", "prompt": "hi", "n": 1, "max_tokens": 1, "max_completion_tokens": 1,
                    "stream": False, "temperature": 0.7,
                    "kv_transfer_params": {"do_remote_decode": True, "kvplane_token": "ab" * 16}}
    assert client["n"] == 3 and client["stream"] is True  # the decode leg gets the client's request
