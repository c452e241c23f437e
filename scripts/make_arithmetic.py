#!/usr/bin/env python3
"""The default task of `streambp-train sft|dpo|grpo`: two-digit addition, in TRL's JSONL formats.

Writes assets/arithmetic/{train,test}.jsonl ({"prompt": "23+45=", "completion": "68"}), a DPO file with
wrong answers as rejected completions, and a character-level tokenizer trained with `tokenizers`
(tokenizer.json + tokenizer_config.json). Deterministic; run it only to change the task.
"""
import json
import os
import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = os.path.join(os.path.dirname(__file__), "..", "assets", "arithmetic")


def main():
    rng = random.Random(0)
    problems = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(problems)
    test, train = problems[:200], problems[200:]
    os.makedirs(OUT, exist_ok=True)

    def write(name, rows):
        with open(os.path.join(OUT, name), "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")

    write("train.jsonl", [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in train])
    write("test.jsonl", [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in test])

    def wrong(a, b):
        off = rng.choice([-10, -2, -1, 1, 2, 10])
        c = abs(a + b + off)
        # |a + b - 10| can be the sum itself (2+3): step the other way, so no pair prefers a sum to itself.
        return str(c if c != a + b else a + b - off)

    write("dpo.jsonl", [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": wrong(a, b)} for a, b in train])
    write("dpo_test.jsonl", [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": wrong(a, b)} for a, b in test])

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # characters join without spaces
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<unk>"])
    text = [f"{a}+{b}={a + b}" for a, b in problems]
    tokenizer.train_from_iterator(text, trainer=trainer)
    tokenizer.save(os.path.join(OUT, "tokenizer.json"))
    with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                   "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64}, f, indent=2)
    print(f"{len(train)} train, {len(test)} test problems, vocab {tokenizer.get_vocab_size()}")


if __name__ == "__main__":
    main()
