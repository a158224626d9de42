#!/usr/bin/env python
"""MiniLM topic classifier that mean-pools: all-MiniLM-L6-v2 + masked mean over tokens + a trained linear layer.

The data: twelve topics (``TOPICS``), sentences written from templates in this file (``dataset()``): per
topic a set of subjects and of predicates, set into shared sentence frames ("I read that {s} {p}.",
"{S} {p}, apparently.", ...), some with a second clause from another topic's subject as a distractor
("... while {other} stayed the same"). Every sentence is distinct; the splits ``train`` (the head),
``calib`` (early-exit calibration: ``CALIB`` per topic) and ``test`` (held back: ``TEST`` per topic) are
disjoint, and the test split's predicates are held out from train and calib (unseen phrasing).

The model: the frozen encoder, masked mean pooling over tokens (as sentence-transformers pools), and a
linear layer of 12 outputs fitted on the pooled features with full-batch L-BFGS (seconds on CPU). The head
is saved beside the encoder weights in the folder ``minilm-topics`` (``topic_head.npz`` and
``graphopt_head.json`` with the data description and accuracies) and exported, parity-gated, through the
``module:function`` source ``models/minilm_topics.py:export_module`` to ``minilm-topics-dynamo.onnx`` in
``$GRAPHOPT_CACHE`` (default ``~/.cache/graphopt/models``): inputs ``input_ids``, ``attention_mask``,
``token_type_ids``; output ``logits`` [batch, 12]; the mean pool (ReduceSum of h * mask / mask sum) is in
the graph.

``--feeds DIR`` also writes ``DIR/calib`` and ``DIR/test`` (``.npz`` feed folders for ``optimize --calib``,
``--batch`` rows each, file order) and ``DIR/calib.txt`` / ``DIR/test.txt`` (one sentence a line).

Usage::

    python models/minilm_topics.py [-o OUT.onnx] [--feeds DIR] [--batch 32]
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _build  # noqa: E402
import minilm  # noqa: E402

logger = logging.getLogger(__name__)

SEED = 0
NAME = "minilm-topics"
#: sentences per topic in each split
TRAIN, CALIB, TEST = 60, 180, 60

# topic: (subjects, predicates); the last PRED_TEST predicates of each topic appear only in the test split
TOPICS: dict[str, tuple[list[str], list[str]]] = {
    "sports": (["the home team", "the striker", "our goalkeeper", "the tennis final", "the marathon runner",
                "the league leaders", "the coach", "the cycling squad", "the boxing champion", "the relay team"],
               ["won the match in extra time", "scored twice in the second half", "was sent off after a foul",
                "broke the national record", "lost the semi-final on penalties", "signed a new contract",
                "trained hard before the tournament", "drew a huge crowd at the stadium",
                "climbed to the top of the table", "was injured during the warm-up"]),
    "weather": (["the storm", "the forecast", "the heatwave", "the morning fog", "the rain", "the cold front",
                 "the wind", "the snowfall", "the humidity", "the thunderstorm"],
                ["flooded several streets overnight", "brought temperatures below freezing",
                 "is expected to clear by the weekend", "knocked down trees along the coast",
                 "made the roads icy and dangerous", "pushed the temperature past forty degrees",
                 "delayed flights at the airport", "left a thick layer of snow on the hills",
                 "turned the sky dark by noon", "soaked everyone waiting for the bus"]),
    "cooking": (["the soup", "my grandmother's recipe", "the sourdough loaf", "the curry", "the pastry chef",
                 "the roast chicken", "the pasta sauce", "the chocolate cake", "the stir fry", "the salad dressing"],
                ["needs a pinch more salt", "simmered for three hours on the stove",
                 "came out of the oven golden and crisp", "uses fresh basil and garlic",
                 "was seasoned with cumin and chili", "rose beautifully overnight", "burned at the bottom of the pan",
                 "tastes better with a squeeze of lemon", "was whisked until it was smooth",
                 "calls for two cups of flour"]),
    "technology": (["the new laptop", "the software update", "the smartphone", "the cloud service",
                    "the graphics card", "the operating system", "the router", "the startup's app",
                    "the database server", "the programming language"],
                   ["crashed after the latest patch", "ships with twice the memory", "runs much faster on the new chip",
                    "lost its connection to the network", "added support for encryption",
                    "drains the battery in a few hours", "was rewritten from scratch",
                    "leaked user passwords in a breach", "compiles the code in seconds",
                    "now syncs files across every device"]),
    "finance": (["the stock market", "the central bank", "the company's shares", "the interest rate",
                 "the pension fund", "the bond yield", "the quarterly profit", "the currency",
                 "the investment bank", "the mortgage lender"],
                ["fell sharply after the earnings report", "raised rates by a quarter point",
                 "beat analysts' expectations", "lost value against the dollar", "paid a record dividend",
                 "cut its forecast for next year", "rallied on news of the merger",
                 "reported a loss for the third quarter", "attracted billions from investors",
                 "tightened lending to small businesses"]),
    "health": (["the patient", "the new vaccine", "the hospital", "the flu season", "the doctor",
                "the clinical trial", "the blood pressure medication", "the nurse", "the surgery",
                "the diet"],
               ["reduced the risk of infection", "recovered quickly after the operation",
                "caused mild side effects in a few people", "admitted more patients this winter",
                "lowered cholesterol within weeks", "required a long stay in intensive care",
                "prescribed rest and plenty of fluids", "showed promising results against the virus",
                "helped with the chronic back pain", "was approved by the health regulator"]),
    "travel": (["our flight", "the hotel", "the train to the coast", "the cruise ship", "the tour guide",
                "the backpacking trip", "the airport lounge", "the rental car", "the ferry", "the road trip"],
               ["was delayed by two hours at the gate", "offered a view of the old harbour",
                "took us through the mountains", "stopped at five islands in a week",
                "showed us the ancient ruins", "needed a visa for the border crossing",
                "was booked solid for the holidays", "lost our luggage on the way",
                "crossed the desert in a day", "left early to catch the sunrise over the bay"]),
    "music": (["the band", "the orchestra", "the new album", "the guitarist", "the jazz trio", "the singer",
               "the festival headliner", "the choir", "the pianist", "the drummer"],
              ["played a sold-out show last night", "released a single on streaming services",
               "performed the symphony without a conductor", "recorded the album in a barn",
               "topped the charts for six weeks", "tuned the strings before the encore",
               "sang a ballad that moved the audience", "toured forty cities this year",
               "improvised a solo for ten minutes", "mixed folk melodies with electronic beats"]),
    "politics": (["the prime minister", "the parliament", "the opposition party", "the senator",
                  "the election campaign", "the new government", "the mayor", "the coalition", "the president",
                  "the city council"],
                 ["passed the budget after a long debate", "called for an early election",
                  "vetoed the controversial bill", "lost its majority in the vote", "promised lower taxes",
                  "resigned after the scandal", "formed an alliance with the greens",
                  "campaigned in the swing states", "debated the new immigration law",
                  "won the referendum by a narrow margin"]),
    "science": (["the telescope", "the research team", "the physicists", "the chemistry lab", "the rover",
                 "the biologists", "the particle accelerator", "the space probe", "the experiment",
                 "the geologists"],
                ["detected a faint signal from a distant galaxy", "sequenced the genome of the plant",
                 "measured the mass of the particle", "found traces of water on the planet",
                 "published the findings in a journal", "observed the reaction under a microscope",
                 "confirmed the theory with new data", "collected rock samples from the crater",
                 "discovered a new species of beetle", "recorded the collision of two black holes"]),
    "movies": (["the director", "the new film", "the lead actress", "the sequel", "the animated feature",
                "the documentary", "the screenwriter", "the horror movie", "the studio", "the film festival"],
               ["premiered at the cinema on Friday", "won the award for best picture",
                "cast an unknown actor in the main role", "earned millions at the box office",
                "was filmed on location in Iceland", "got poor reviews from the critics",
                "shot the final scene in one take", "rewrote the script three times",
                "kept the audience on the edge of their seats", "was dubbed into twenty languages"]),
    "education": (["the school", "the university", "the students", "the teacher", "the exam board",
                   "the kindergarten", "the professor", "the online course", "the library", "the graduates"],
                  ["raised the tuition fees", "introduced a new maths curriculum", "passed the final exams",
                   "hired more teachers for the autumn term", "graded the essays over the weekend",
                   "offered scholarships to poor students", "extended the opening hours for revision",
                   "lectured on the history of philosophy", "switched the classes to remote learning",
                   "celebrated the graduation ceremony"]),
}
LABELS = list(TOPICS)
PRED_TEST = 2
FRAMES = [
    "{S} {p}.",
    "I read that {s} {p}.",
    "Yesterday {s} {p}.",
    "Apparently {s} {p}.",
    "Everyone is talking about how {s} {p}.",
    "According to the news, {s} {p}.",
    "My neighbour told me {s} {p}.",
    "It is surprising that {s} {p}.",
    "Last week {s} {p}, which nobody expected.",
    "{S} {p}, and people were not happy about it.",
    "Did you hear that {s} {p}?",
    "For the first time in years, {s} {p}.",
    "{S} {p} while {o} stayed the same.",
    "Although {o} was in the headlines, {s} {p}.",
]


def _sentence(frame: str, subj: str, pred: str, other: str) -> str:
    return frame.format(S=subj[0].upper() + subj[1:], s=subj, p=pred, o=other)


def dataset(seed: int = SEED, train: int = TRAIN, calib: int = CALIB, test: int = TEST
            ) -> dict[str, list[tuple[str, int]]]:
    """``{"train", "calib", "test"}`` lists of (sentence, label), deterministic by ``seed``, shuffled.

    All sentences are distinct; ``test`` draws from each topic's last ``PRED_TEST`` predicates only, which
    ``train`` and ``calib`` never use. The distractor subject of two-clause frames comes from another topic.
    """
    rng = random.Random(seed)
    out: dict[str, list[tuple[str, int]]] = {"train": [], "calib": [], "test": []}
    all_subjects = [(t, s) for t, (subs, _) in TOPICS.items() for s in subs]
    for label, (topic, (subs, preds)) in enumerate(TOPICS.items()):
        others = [s for t, s in all_subjects if t != topic]
        seen, held = preds[:-PRED_TEST], preds[-PRED_TEST:]
        for part, pool, count in (("train+calib", seen, train + calib), ("test", held, test)):
            combos = list(itertools.product(FRAMES, subs, pool))
            rng.shuffle(combos)
            if len(combos) < count:
                raise ValueError(f"{topic}: {len(combos)} {part} sentences, {count} wanted")
            items = [(_sentence(f, s, p, rng.choice(others)), label) for f, s, p in combos[:count]]
            if part == "test":
                out["test"] += items
            else:
                out["train"] += items[:train]
                out["calib"] += items[train:]
    for v in out.values():
        rng.shuffle(v)
    return out


def _pooled(encoder, tokenizer, texts: list[str]):
    import torch

    outs = []
    with torch.no_grad():
        for i in range(0, len(texts), 64):
            enc = tokenizer(texts[i : i + 64], padding=True, return_tensors="pt")
            outs.append(_mean_pool(encoder(**enc).last_hidden_state, enc["attention_mask"]))
    return torch.cat(outs)


def _mean_pool(h, mask):
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


def train_folder(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The folder of the encoder (HF files) + ``topic_head.npz`` (built when missing or ``force``)."""
    _build.offline()
    dst = _build.cache_dir(cache_dir) / NAME
    if (dst / "topic_head.npz").is_file() and not force:
        return dst

    def write(tmp: Path) -> None:
        import numpy as np
        import torch

        tok, encoder = minilm.load_source()
        data = dataset()
        xs = {k: _pooled(encoder, tok, [t for t, _ in v]) for k, v in data.items()}
        ys = {k: torch.tensor([y for _, y in v]) for k, v in data.items()}
        w, b = _build.fit_linear_head(xs["train"], ys["train"], len(LABELS), SEED, max_iter=300)
        with torch.no_grad():
            acc = {k: float(((xs[k] @ w.T + b).argmax(1) == ys[k]).float().mean()) for k in xs}
        encoder.config._attn_implementation = None
        encoder.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        np.savez(tmp / "topic_head.npz", weight=w.numpy().astype(np.float32), bias=b.numpy().astype(np.float32))
        info = {
            "data": "templated 12-topic sentences (models/minilm_topics.py: dataset())", "labels": LABELS,
            **{f"{k}_rows": len(v) for k, v in data.items()}, "seed": SEED,
            **{f"{k}_accuracy": a for k, a in acc.items()},
            "head": "linear layer on the masked mean of the frozen MiniLM's last hidden state (L-BFGS, L2 1e-3)",
        }
        (tmp / "graphopt_head.json").write_text(json.dumps(info, indent=2) + "\n")
        logger.info("topic head: accuracy %s", acc)

    return _build.place_dir(write, dst)


def export_module():
    """``module:function`` export source: (encoder + masked mean + linear, example inputs)."""
    import numpy as np
    import torch
    import transformers

    folder = train_folder()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    encoder = transformers.AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    head = np.load(folder / "topic_head.npz")

    class TopicClassifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = encoder
            self.classifier = torch.nn.Linear(head["weight"].shape[1], head["weight"].shape[0])
            with torch.no_grad():
                self.classifier.weight.copy_(torch.from_numpy(head["weight"]))
                self.classifier.bias.copy_(torch.from_numpy(head["bias"]))

        def forward(self, input_ids, attention_mask, token_type_ids):
            h = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state
            return self.classifier(_mean_pool(h, attention_mask))

    enc = tok(["The striker scored twice in the second half.", "Rain."], padding=True, return_tensors="pt")
    inputs = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    return TopicClassifier().eval(), inputs


def build(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The cached ONNX export (output ``logits`` [batch, 12])."""
    train_folder(cache_dir, force)
    return _build.export_cached(f"{Path(__file__).resolve()}:export_module", f"{NAME}-dynamo",
                                task="sequence-classification", exporter="dynamo", cache=cache_dir, force=force)


def write_feeds(out: Path, batch: int = 32, cache_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """``out/calib`` and ``out/test`` feed folders (``batch`` rows each, file order) and their ``.txt``."""
    from graphopt.data.feeds.folder import save_dir
    from graphopt.exporters import text_feeds

    tok = text_feeds.load_tokenizer(train_folder(cache_dir))
    data = dataset()
    paths = {}
    for part in ("calib", "test"):
        lines = [t for t, _ in data[part]]
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{part}.txt").write_text("\n".join(lines) + "\n")
        feeds, _ = text_feeds.text_feeds(tok, lines, batch=batch, order="file")
        paths[part] = save_dir(feeds, out / part)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = _build.parser(__doc__)
    ap.add_argument("-o", "--output", type=Path)
    ap.add_argument("--feeds", type=Path, default=None, help="write calib/ and test/ feed folders here")
    ap.add_argument("--batch", type=int, default=32, help="rows per feed in --feeds")
    args = _build.parse_args(ap, argv)

    def body() -> int:
        path = build(args.cache_dir, args.force)
        info = json.loads((train_folder(args.cache_dir) / "graphopt_head.json").read_text())
        print(f"topic head: accuracy train {info['train_accuracy']:.3f}, calib {info['calib_accuracy']:.3f}, "
              f"test {info['test_accuracy']:.3f} ({info['test_rows']} unseen sentences)", file=sys.stderr)
        if args.feeds:
            for part, p in write_feeds(args.feeds, args.batch, args.cache_dir).items():
                print(f"{part} feeds: {p}", file=sys.stderr)
        if args.output:
            path = _build.place_file(path, args.output)
        print(path)
        return 0

    return _build.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
