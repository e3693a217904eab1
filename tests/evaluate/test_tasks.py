"""Task metrics (kiln.evaluate.tasks) without a model: reading and refusing evaluation sets, the metrics against
hand-computed values and sacrebleu, the paired bootstrap, and kiln gate's task thresholds (value and interval
bound)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kiln.errors import UsageError
from kiln.evaluate import gate, tasks


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("row,task", [
    ({"text": "good film", "label": "positive"}, "classification"),
    ({"prompt": "Q?", "choices": ["a", "b"], "answer": 1}, "multiple_choice"),
    ({"prompt": "Q?", "answer": "a"}, "exact_match"),
    ({"source": "Guten Tag", "reference": "Good day"}, "translation"),
    ({"text": "plain text"}, "perplexity"),
])
def test_the_fields_name_the_task(tmp_path, row, task):
    s = tasks.read_eval(write(tmp_path / "e.jsonl", [row, row]))
    assert s.task == task and len(s.rows) == 2


def test_summaries_are_named_and_answers_may_be_the_choice_itself(tmp_path):
    s = tasks.read_eval(write(tmp_path / "e.jsonl", [{"source": "a long text", "reference": "short"}]), "summarization")
    assert s.task == "summarization"
    s = tasks.read_eval(write(tmp_path / "m.jsonl", [{"prompt": "Q?", "choices": ["x", "y", "z"], "answer": "z"}]))
    assert s.rows[0]["answer"] == 2
    assert len(tasks.read_eval(write(tmp_path / "n.jsonl", [{"text": "t"}] * 9), max_examples=4).rows) == 4


@pytest.mark.parametrize("rows,needle", [
    (['{"text": "a", "label": 1}', "{not json"], "e.jsonl:2 is not a JSON object"),
    (['[1, 2]'], "e.jsonl:1 is not a JSON object"),
    ([{"foo": 1}], "name no task"),
    ([{"prompt": "Q?", "choices": ["a", "b"], "answer": 2}], "\"answer\" must be an index"),
    ([{"prompt": "Q?", "choices": ["a"], "answer": 0}], "2 to 26 strings"),
    ([{"prompt": "Q?", "choices": ["a", ""], "answer": 0}], "choice 1"),
    ([{"text": "a", "label": True}], "\"label\" must be a class id"),
    ([{"text": "a", "label": 1}, {"text": "b"}], "e.jsonl:2: a classification example needs text, label"),
    ([{"text": "x" * (tasks.MAX_FIELD_CHARS + 1)}], "over 20000 characters"),
    ([""], "has no examples"),
])
def test_unusable_sets_are_refused_naming_the_line(tmp_path, rows, needle):
    with pytest.raises(UsageError, match=needle.replace("[", r"\[").replace("\"", "\"")):
        tasks.read_eval(write(tmp_path / "e.jsonl", rows))


def test_a_missing_or_huge_file_and_an_unknown_task_are_refused(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match="does not exist"):
        tasks.read_eval(tmp_path / "none.jsonl")
    with pytest.raises(UsageError, match="is not one of"):
        tasks.read_eval(write(tmp_path / "e.jsonl", [{"text": "a"}]), "sentiment")
    monkeypatch.setattr(tasks, "MAX_EVAL_BYTES", 10)
    with pytest.raises(UsageError, match="is over"):
        tasks.read_eval(write(tmp_path / "e.jsonl", [{"text": "a long enough line"}]))


def test_macro_f1_matches_a_hand_count():
    gold = np.array([0, 0, 0, 1, 1, 2])
    pred = np.array([0, 0, 1, 1, 2, 2])
    # class 0: tp 2 fp 0 fn 1 -> 0.8; class 1: tp 1 fp 1 fn 1 -> 0.5; class 2: tp 1 fp 1 fn 0 -> 2/3
    assert tasks.f1_macro(pred, gold) == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
    assert tasks.f1_macro(gold, gold) == 1.0


def test_continuation_splits_as_lm_evaluation_harness():
    vocab = {"Answer:": 1, " Paris": 2, " ": 3, "Paris": 4}

    def encode(text):
        out, i = [], 0
        while i < len(text):
            for piece in sorted(vocab, key=len, reverse=True):
                if text.startswith(piece, i):
                    out.append(vocab[piece])
                    i += len(piece)
                    break
            else:
                raise AssertionError(text[i:])
        return out

    assert tasks.continuation(encode, "Answer:", " Paris") == ([1], [2])
    # a context's trailing space moves to the continuation, where the tokenizer merges it with the word
    assert tasks.continuation(encode, "Answer: ", "Paris") == ([1], [2])


class Fixed:
    """A scorer whose next-token logits make `favourite` the likeliest token everywhere."""

    def __init__(self, favourite: int, vocab: int = 8):
        self.favourite, self.vocab = favourite, vocab

    def logits(self, ids):
        out = np.zeros((len(ids), self.vocab))
        out[:, self.favourite] = 5.0
        return out

    def classify(self, ids):
        return np.eye(3)[ids[0] % 3]

    def generate(self, ids, new):
        return [self.favourite] * new


def toy_text():
    return tasks.Text(encode=lambda t: [ord(c) % 8 for c in t], decode=lambda ids: "".join(chr(97 + i) for i in ids),
                      stop=[7], labels={"zero": 0, "one": 1, "two": 2}, limit=64)


def test_multiple_choice_picks_the_likeliest_choice_and_exact_match_normalises(tmp_path):
    text = toy_text()
    mc = tasks.read_eval(write(tmp_path / "m.jsonl", [{"prompt": "q", "choices": ["a", "e"], "answer": 1},
                                                     {"prompt": "q", "choices": ["e", "a"], "answer": 1}]))
    # " e" -> [0, 5]: the scorer favouring 5 prefers the choice "e"
    out = tasks.run_set(Fixed(5), mc, text)
    assert out.predictions == [1, 0] and list(out.values["correct"]) == [1.0, 0.0]
    em = tasks.read_eval(write(tmp_path / "e.jsonl", [{"prompt": "q", "answer": " BBB."}, {"prompt": "q", "answer": "c"}]))
    em.max_new_tokens = 3
    out = tasks.run_set(Fixed(1), em, text)  # generates "bbb": equal to " BBB." after normalising
    assert out.texts == ["bbb", "bbb"] and list(out.values["correct"]) == [1.0, 0.0]
    assert tasks.normalized(' "Paris." ') == "paris"


def test_classification_maps_label_names_and_refuses_unknown_ones(tmp_path):
    text = toy_text()
    s = tasks.read_eval(write(tmp_path / "c.jsonl", [{"text": "a", "label": "one"}, {"text": "b", "label": 2}]))
    out = tasks.run_set(Fixed(0), s, text)  # classify: class of ord(first char) % 8 % 3
    assert list(out.values["gold"]) == [1, 2]
    bad = tasks.read_eval(write(tmp_path / "d.jsonl", [{"text": "a", "label": "neutral"}]))
    with pytest.raises(UsageError, match="'neutral' is not one of the model's labels"):
        tasks.run_set(Fixed(0), bad, text)


def outcome(correct):
    return tasks.Outcome("multiple_choice", {"correct": np.asarray(correct, float)})


def test_the_drop_and_its_paired_interval():
    s = tasks.EvalSet(tasks.Path("set.jsonl"), "multiple_choice", [{}] * 40)
    same = tasks.compare(outcome([1] * 30 + [0] * 10), outcome([1] * 30 + [0] * 10), s)["metrics"]["accuracy"]
    assert same["drop"] == 0 and same["drop_interval"] == [0, 0]  # paired: identical answers never differ
    assert same["interval"][0] < 0.75 < same["interval"][1]
    worse = tasks.compare(outcome([1] * 20 + [0] * 20), outcome([1] * 30 + [0] * 10), s)["metrics"]["accuracy"]
    assert worse["drop"] == pytest.approx(0.25) and worse["drop_pct"] == pytest.approx(100 / 3)
    assert 0.1 < worse["drop_interval"][0] < 0.25 < worse["drop_interval"][1] <= 0.4
    # a single different answer: a small drop whose interval reaches zero
    one = tasks.compare(outcome([1] * 29 + [0] * 11), outcome([1] * 30 + [0] * 10), s)["metrics"]["accuracy"]
    assert one["drop"] == pytest.approx(0.025) and one["drop_interval"][0] == 0


def test_bleu_and_chrf_are_sacrebleu_corpus_scores():
    sacrebleu = pytest.importorskip("sacrebleu")
    refs = ["the cat sat on the mat", "a dog ran in the park", "it is raining today"]
    hyps = ["the cat sat on a mat", "a dog runs in the park", "it rains today"]
    s = tasks.EvalSet(tasks.Path("t.jsonl"), "translation", [{"reference": r} for r in refs])
    got = tasks.metric_values(tasks.Outcome("translation", texts=hyps), s, np.arange(3))
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert got["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)


def test_rouge_and_perplexity():
    pytest.importorskip("rouge_score")
    rows = tasks.rouge_rows(["the cat sat"], ["the cat sat"])
    assert rows["rouge1"][0] == pytest.approx(100) and rows["rouge_l"][0] == pytest.approx(100)
    s = tasks.EvalSet(tasks.Path("p.jsonl"), "perplexity", [{}, {}])
    out = tasks.Outcome("perplexity", {"nll": np.array([2.0, 4.0]), "count": np.array([2.0, 2.0])})
    assert tasks.metric_values(out, s, np.arange(2))["perplexity"] == pytest.approx(math.exp(1.5))


def task_entry(value, reference, lo, hi, metric="accuracy"):
    m = {"value": value, "reference": reference, "drop": reference - value,
         "drop_pct": 100 * (reference - value) / reference, "interval": [value - 0.05, value + 0.05],
         "drop_interval": [lo, hi], "higher_is_better": True}
    return {"metrics": {}, "latency": {"p50_ms": 1.0}, "tasks": [{"name": "set.jsonl", "task": "multiple_choice",
                                                                   "examples": 40, "metrics": {metric: m}}]}


def test_gate_reads_task_thresholds_and_the_interval_bound():
    e = task_entry(0.90, 0.91, -0.01, 0.04)
    checks = gate.evaluate(e, {"max_accuracy_drop": 0.02, "min_accuracy": 0.88})
    assert [c.passed for c in checks] == [True, True] and "set.jsonl" in checks[0].label
    # the drop's upper bound (0.04) exceeds 0.02; the accuracy's lower bound (0.85) is under 0.88
    checks = gate.evaluate(e, {"max_accuracy_drop": 0.02, "min_accuracy": 0.88, "gate_on": "upper"})
    assert [(c.value, c.passed) for c in checks] == [(0.04, False), (pytest.approx(0.85), False)]
    pct = gate.evaluate(task_entry(30.0, 32.0, 0.5, 3.0, "bleu"), {"max_bleu_drop_pct": 5.0})[0]
    assert pct.value == pytest.approx(6.25) and not pct.passed
    with pytest.raises(gate.GateInputError, match="no evaluation set measuring bleu"):
        gate.evaluate(e, {"min_bleu": 20.0})
    broken = task_entry(0.9, 0.91, -0.01, 0.04)
    broken["tasks"][0]["metrics"]["accuracy"]["drop_interval"] = ["a", None]
    with pytest.raises(gate.GateInputError, match="no bootstrap drop_interval"):
        gate.evaluate(broken, {"max_accuracy_drop": 0.02, "gate_on": "upper"})


def test_gate_on_is_read_from_toml_and_checked(tmp_path):
    (tmp_path / "kiln.toml").write_text('[gate]\nmax_accuracy_drop = 0.01\ngate_on = "upper"\n')
    assert gate.load_thresholds(None, {}, tmp_path) == {"max_accuracy_drop": 0.01, "gate_on": "upper"}
    (tmp_path / "kiln.toml").write_text('[gate]\nmax_accuracy_drop = 0.01\ngate_on = "lower"\n')
    with pytest.raises(gate.GateInputError, match="gate_on = 'lower'"):
        gate.load_thresholds(None, {}, tmp_path)
    (tmp_path / "kiln.toml").write_text('[gate]\ngate_on = "upper"\n')
    with pytest.raises(gate.GateInputError, match="no thresholds"):
        gate.load_thresholds(None, {}, tmp_path)


def test_entities_are_read_as_conlleval_reads_bio_tags():
    tags = ["B-PER", "I-PER", "O", "I-LOC", "I-LOC", "B-LOC", "B-ORG", "I-PER", "O"]
    assert tasks.entities(tags) == {(0, 2, "PER"), (3, 5, "LOC"), (5, 6, "LOC"), (6, 7, "ORG"), (7, 8, "PER")}
    assert tasks.entities(["O", "O"]) == set()


def test_token_classification_scores_each_word_on_its_first_token(tmp_path):
    text = tasks.Text(encode=lambda t: [], decode=lambda ids: "", stop=[], labels={"O": 0, "B-PER": 1, "I-PER": 2},
                      limit=64, words=lambda words: ([0, *range(1, 2 * len(words) + 1), 0],
                                                     [None, *(i // 2 for i in range(2 * len(words))), None]))

    class Tagger:  # tags token t with label (t // 2) % 3 ... except the second token of each word, which it garbles
        def classify(self, ids):
            out = np.zeros((len(ids), 3))
            for t in range(len(ids)):
                out[t, [0, 1, 2][(t - 1) // 2 % 3] if t % 2 else 0] = 1.0
            return out

    s = tasks.read_eval(write(tmp_path / "t.jsonl", [{"tokens": ["Ada", "Love", "x"], "tags": ["O", "B-PER", "I-PER"]},
                                                     {"tokens": ["Bob", "y"], "tags": ["B-PER", "O"]}]))
    assert s.task == "token_classification"
    out = tasks.run_set(Tagger(), s, text)
    assert out.predictions == [["O", "B-PER", "I-PER"], ["O", "B-PER"]]
    got = tasks.metric_values(out, s, np.arange(2))
    # entities: gold {(1,3,PER)}, {(0,1,PER)}; predicted {(1,3,PER)}, {(1,2,PER)}: tp 1, fp 1, fn 1
    assert got["entity_f1"] == pytest.approx(0.5) and got["accuracy"] == pytest.approx(3 / 5)
    bad = tasks.read_eval(write(tmp_path / "u.jsonl", [{"tokens": ["a"], "tags": ["B-LOC"]}]))
    with pytest.raises(UsageError, match="tag 'B-LOC' is not one of the model's labels"):
        tasks.run_set(Tagger(), bad, text)
    with pytest.raises(UsageError, match="lists of the same length"):
        tasks.read_eval(write(tmp_path / "v.jsonl", [{"tokens": ["a", "b"], "tags": ["O"]}]))


def test_a_set_without_entities_has_no_entity_f1():
    """Nothing to measure is absent, never a score: no gold and no predicted entity leaves entity F1 out."""
    s = tasks.EvalSet(tasks.Path("t.jsonl"), "token_classification", [{}] * 3)
    out = tasks.Outcome("token_classification", {"tp_fp_fn": np.zeros((3, 3)), "correct": np.ones(3) * 2,
                                                 "words": np.ones(3) * 2})
    got = tasks.compare(out, out, s)["metrics"]
    assert "entity_f1" not in got and got["accuracy"]["value"] == 1.0
