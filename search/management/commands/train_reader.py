"""``manage.py train_reader``: train the reader's LoRA updates and head (search/answering/reader_training.py)
and write them to ``search/reader/weights/``, with the held-out figures in its manifest.

About 30 minutes on 2 cores. Seeded: a second run on the same machine writes the same weights
(up to the floating-point order of the CPU's kernels). No database is needed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from django.core.management.base import BaseCommand

from search.answering import reader_training as training


class Command(BaseCommand):
    help = "Train the reader (answers / supports) from the data it may learn from; report on the rest."

    def add_arguments(self, parser):
        parser.add_argument("--seed", type=int, default=49)
        parser.add_argument("--epochs", type=int, default=3)
        parser.add_argument("--lr", type=float, default=4e-4)
        parser.add_argument("--batch-tokens", type=int, default=3072)
        parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
        parser.add_argument(
            "--without-tuned-sets",
            action="store_true",
            help="Learn without the demo's tuned question sets (what the decline lines are chosen on).",
        )
        parser.add_argument(
            "--output", type=Path, default=None, help="Write the weights here (default: search/reader/weights/)."
        )

    def handle(self, *args, seed, epochs, lr, batch_tokens, threads, without_tuned_sets, output, **options):
        if threads:
            torch.set_num_threads(threads)
        rng = random.Random(seed)  # noqa: S311 (a reproducible sample, not a secret)
        examples = training.examples(rng, held_out=False, tuned_sets=not without_tuned_sets)
        tests = training.examples(rng, held_out=True)
        self.stderr.write(f"{len(examples)} training pairs, {len(tests)} held-out pairs")
        trainer = training.Trainer(seed=seed, log=self.stderr.write)
        figures = trainer.train(examples, tests, epochs=epochs, lr=lr, batch_tokens=batch_tokens)
        trainer.save(
            figures,
            epochs=epochs,
            lr=lr,
            batch_tokens=batch_tokens,
            tuned_sets=not without_tuned_sets,
            directory=output,
        )
        self.stdout.write(json.dumps(figures["held_out"], ensure_ascii=False))
