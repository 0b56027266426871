"""The step's heads against plain numpy: the greedy token (first index of the maximum, ties
included), its logprob only where a row asked (`want_top` 1 or 2), the top-K only at 2, the
prompt-logprob head's ranks, and the masked heads' allowed tokens."""

import numpy as np

from paged_jax.worker.step_head import allowed, first_max, greedy_head, greedy_head_masked, prompt_logprob_head


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_first_max_is_argmax_with_ties():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 1000)).astype(np.float32)
    logits[1, [3, 700]] = 50.0  # a tie: the first index wins, as np.argmax
    logits[2, :] = 0.0  # all equal
    logits[3, -1] = np.inf
    assert np.asarray(first_max(logits)).tolist() == np.argmax(logits, axis=-1).tolist()


def test_greedy_head_logprobs_only_where_asked():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 300)).astype(np.float32) * 3
    want = np.argmax(logits, -1)
    reference = _log_softmax(logits)[np.arange(4), want]
    for level in (1, 2):
        out = greedy_head(logits, np.array([level], np.int32), k=5)
        assert np.asarray(out.tokens).tolist() == want.tolist()
        np.testing.assert_allclose(np.asarray(out.logprobs), reference, atol=1e-5)
        tops = np.asarray(out.top_ids)
        if level == 2:
            assert tops.tolist() == np.argsort(-logits, -1)[:, :5].tolist()
        else:
            assert not tops.any()  # no top-K computed
    out = greedy_head(logits, np.array([0], np.int32), k=5)  # nobody asked: the tokens alone are right
    assert np.asarray(out.tokens).tolist() == want.tolist()


def test_masked_greedy_and_prompt_head():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((2, 70)).astype(np.float32)
    mask = np.zeros((2, 3), np.int32)  # 70 tokens -> 3 words
    mask[0, 1] = 1 << 5  # only token 37 allowed in row 0
    mask[1] = -1  # everything in row 1
    assert np.asarray(allowed(mask, 70)).sum(-1).tolist() == [1, 70]
    out = greedy_head_masked(logits, mask, np.array([1], np.int32), k=3)
    assert np.asarray(out.tokens).tolist() == [37, int(np.argmax(logits[1]))]
    np.testing.assert_allclose(np.asarray(out.logprobs)[0], _log_softmax(logits)[0, 37], atol=1e-5)  # model's own
    targets = np.array([int(np.argsort(-logits[0])[4]), int(np.argmax(logits[1]))], np.int32)
    lp, ranks, top_lp, top_ids = prompt_logprob_head(logits, targets, k=3)
    assert np.asarray(ranks).tolist() == [5, 1]
    np.testing.assert_allclose(np.asarray(lp), _log_softmax(logits)[[0, 1], targets], atol=1e-5)
    assert np.asarray(top_ids).tolist() == np.argsort(-logits, -1)[:, :3].tolist()
