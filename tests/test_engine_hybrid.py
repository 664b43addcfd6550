"""The engine on a hybrid recurrent model (Qwen3.5-shaped, random weights, SmolLM2's tokenizer): recurrent
state is one whole state per sequence, so it is shared only whole (seq_cp copies it on the fork) and
never cut part-way; the answers equal those of single runs."""

from __future__ import annotations

import pytest

import ctxq
from ctxq.runtime.generate import generate, input_tokens
from ctxq.runtime.engine import Engine, SamplingParams

DOC = " ".join(f"Room {i} is painted {c}." for i, c in enumerate(["red", "blue", "green"] * 20))
QUESTIONS = ["What colour is room 3?", "Which room is blue?", "Name a green room."]
GREEDY = dict(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from ctxq.testing.hybrid_chat import tiny_chat_qwen35_gguf

    path = str(tiny_chat_qwen35_gguf(tmp_path_factory.mktemp("hybrid") / "chat-qwen35.gguf"))
    llm = ctxq.load(path, n_ctx=2048, kv="f16")
    prompts = [input_tokens(path, q, document=DOC, chat=True) for q in QUESTIONS]
    yield llm, prompts
    llm.close()


def test_hybrid_questions_together_share_the_document_state_and_answer_as_single_runs(hybrid):
    llm, prompts = hybrid
    single = [generate(llm, t, n_predict=GREEDY["max_tokens"], temp=0, keep=keep).tokens for t, keep in prompts]
    with Engine(llm, n_seq_max=4) as e:
        assert e.recurrent
        keeps = {keep for _, keep in prompts}
        assert len(keeps) == 1  # one document
        # queued together (Engine.submit_all): one by one, the first can be past the document's end before the
        # next arrives on a busy machine, and a recurrent state is shared only at that exact point
        reqs = e.submit_all([t for t, _ in prompts], SamplingParams(**GREEDY), share_limit=keeps.pop())
        results = [r.result() for r in reqs]
        st = e.stats()
    keep = prompts[0][1]
    assert st.prompt_tokens_evaluated == keep + sum(len(t) - keep for t, _ in prompts)  # the document once
    assert [r.cached_tokens for r in results] == [0, keep, keep]
    texts = [llm.detokenize(s).decode("utf-8", "replace") for s in single]
    matches = sum(r.text == t for r, t in zip(results, texts))
    print(f"hybrid: greedy answers equal to single runs: {matches} of {len(prompts)}")
    assert matches >= len(prompts) - 1, list(zip([r.text for r in results], texts))


def test_hybrid_state_is_never_cut_part_way(hybrid):
    """After doc+Q1+answer is resident, doc+Q2 shares nothing of it (its state is past the fork point);
    with the document prefilled on its own, doc+Q2 forks from that whole state."""
    llm, prompts = hybrid
    (t1, keep), (t2, _) = prompts[0], prompts[1]
    single = generate(llm, t2, n_predict=GREEDY["max_tokens"], temp=0, keep=keep).tokens
    expected = llm.detokenize(single).decode("utf-8", "replace")
    with Engine(llm, n_seq_max=3) as e:
        e.submit(t1, SamplingParams(**GREEDY)).result()
        alone = e.submit(t2, SamplingParams(**GREEDY), share_limit=keep).result()
        e.prefill(t1[:keep]).result()
        forked = e.submit(t2, SamplingParams(**GREEDY), share_limit=keep).result()
    assert alone.cached_tokens == 0 and alone.text == expected
    assert forked.cached_tokens == keep and forked.text == expected
    # the answer depends on the recurrent state: another document answers otherwise
    other = input_tokens(llm.model_path, QUESTIONS[1], document="The market opens at dawn. " * 40, chat=True)[0]
    assert generate(llm, other, n_predict=GREEDY["max_tokens"], temp=0).tokens != single


def test_hybrid_cancel_frees_the_sequence(hybrid):
    llm, prompts = hybrid
    t, _ = prompts[2]
    with Engine(llm, n_seq_max=2) as e:
        r = e.submit(t, SamplingParams(temperature=0.0, max_tokens=500, logit_bias={llm.token_eos(): -100.0}))
        next(iter(r))
        r.cancel()
        assert r.wait(60) and r.finish_reason == "cancelled"
        st = e.stats()
    assert st.sequences_active == 0 and st.cells_used == 0
