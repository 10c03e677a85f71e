"""Teacher-forced evaluation on ``data.eval_file`` during training: the loss, and how often the model's
most likely next token is the target (every answer token, the digits, the digits by place value, whole
answers).

One forward per micro-batch serves the loss and the predictions. Every rank runs the same number of
forwards (ZeRO-3 gathers parameters collectively): a rank with fewer eval samples runs a repeat of one
with every target ignored. The sums of all ranks travel in one named all-reduce.

Under sequence parallelism the ranks of a group evaluate their group's micro-batches once, sliced as in
training (each rank's logits are its slice's: never a long row's whole logits): each reports its share
of the loss, and the predictions and targets of the whole rows (small integer tensors) are gathered to
count accuracies, which the group's first rank adds (a number's places and an answer's correctness span
the cut).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from ntil_ds.config import Config
from ntil_ds.constants import IGNORE_INDEX
from ntil_ds.data import Collator, ConversationDataset
from ntil_ds.data.batch import MicroBatch
from ntil_ds.dist import DistInfo, all_reduce_sums, read_to_host
from ntil_ds.loss.numbers import analyse_numbers
from ntil_ds.model.sequence_parallel import ulysses_in_evaluation
from ntil_ds.objective import Objective, gumbel_generator

DIGIT_PLACES_REPORTED = 6  # eval logs digit_acc_pos0 (units) .. digit_acc_pos5


def digit_accuracy_by_place(
    predicted: torch.Tensor, labels: torch.Tensor, digit_ids: torch.Tensor, num_places: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced digit accuracy by place value: ``(counts, correct)``, each ``[num_places]``, for
    place 0 (units), 1 (tens), ... Numbers are read from the targets exactly as the loss reads them."""
    layout = analyse_numbers(labels, digit_ids, ignore_index=IGNORE_INDEX)
    counted = layout.is_digit & (layout.place >= 0) & (layout.place < num_places)
    right = counted & (predicted == labels)
    counts = torch.bincount(layout.place[counted], minlength=num_places)
    correct = torch.bincount(layout.place[right], minlength=num_places)
    return counts, correct


class TeacherForcedEval:
    """``run(step)`` evaluates; ``due(step)`` says whether the recipe's cadence (train.eval_every) asks
    for it after that step."""

    def __init__(
        self,
        cfg: Config,
        dataset: ConversationDataset,
        collator: Collator,
        objective: Objective,
        dist_info: DistInfo,
    ) -> None:
        self.dataset, self.collator, self.objective, self.dist = dataset, collator, objective, dist_info
        self.micro_batch_size, self.every, self.seed = (
            cfg.train.micro_batch_size,
            cfg.train.eval_every,
            cfg.train.seed,
        )

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def batches(self) -> list[MicroBatch]:
        """This rank's eval micro-batches: as many on every rank (fillers where it has run out)."""
        n, dp, size = len(self.dataset), self.dist.dp_size, self.micro_batch_size
        mine = list(range(self.dist.dp_rank, n, dp))
        out = []
        for b in range(math.ceil(math.ceil(n / dp) / size)):
            ids = mine[b * size : (b + 1) * size]
            chosen = ids or mine[:1] or [0]
            batch = MicroBatch(chosen, self.collator([self.dataset[i] for i in chosen]))
            batch = batch if ids else batch.without_targets()
            if self.dist.sp_size > 1:  # this rank's slice of the group's rows
                batch = batch.slice_sequence(
                    self.dist.sp_rank, self.dist.sp_size, whole_rows=self.objective.multimodal
                )
            out.append(batch)
        return out

    @torch.no_grad()
    def run(self, step: int) -> dict[str, float]:
        """COLLECTIVE: eval loss and teacher-forced accuracies of answer tokens, digits, whole answers."""
        objective = self.objective
        objective.engine.eval()
        device = objective.device
        digit_ids = torch.tensor(objective.loss_fn.digit_token_ids, device=device)
        names = ("loss_sum", "ce_sum", "tokens", "correct_tokens", "digits", "correct_digits", "answers")
        sums = {
            name: torch.zeros((), dtype=torch.float64, device=device) for name in (*names, "correct_answers")
        }
        # digits seen and digits right, by place value (units first): the "error by digit position" plot
        sums["digits_by_place"] = torch.zeros(DIGIT_PLACES_REPORTED, dtype=torch.float64, device=device)
        sums["correct_digits_by_place"] = torch.zeros(
            DIGIT_PLACES_REPORTED, dtype=torch.float64, device=device
        )
        for index, batch in enumerate(self.batches()):
            with ulysses_in_evaluation() if batch.sequence else nullcontext():
                logits = objective.logits(batch)
            generator = gumbel_generator(self.seed, step, index, self.dist.dp_rank, device, evaluation=True)
            out = objective.loss_of_logits(logits, batch, generator)
            sums["loss_sum"] += out.loss_sum.double()  # sliced: this rank's share
            sums["ce_sum"] += out.ce_sum.double()
            targets = batch.targets.to(device)
            predicted = objective.argmax_over_vocab(logits)
            if batch.sequence is not None:  # whole rows, counted once a group
                shard = objective.sequence_shard(batch)
                targets, predicted = (shard.gather(t, differentiable=False) for t in (targets, predicted))
                if self.dist.sp_rank:
                    continue
            labelled = targets != IGNORE_INDEX
            is_digit = torch.isin(targets, digit_ids)
            correct = predicted == targets
            answered = labelled.any(dim=1)  # rows with something to predict (not the masked filler)
            all_correct = (correct | ~labelled).all(dim=1) & answered
            for name, value in (
                ("tokens", labelled.sum()),
                ("correct_tokens", (correct & labelled).sum()),
                ("digits", is_digit.sum()),
                ("correct_digits", (correct & is_digit).sum()),
                ("answers", answered.sum()),
                ("correct_answers", all_correct.sum()),
            ):
                sums[name] += value.double()
            counts, right = digit_accuracy_by_place(predicted, targets, digit_ids, DIGIT_PLACES_REPORTED)
            sums["digits_by_place"] += counts.double()
            sums["correct_digits_by_place"] += right.double()
        objective.engine.train()
        total = read_to_host(all_reduce_sums(sums, device))
        seen, right = total["digits_by_place"], total["correct_digits_by_place"]
        by_place = {f"digit_acc_pos{k}": right[k] / seen[k] for k in range(DIGIT_PLACES_REPORTED) if seen[k]}
        tokens = max(total["tokens"], 1.0)
        return {
            "labelled_tokens": total["tokens"],  # each evaluated once (a group's ranks do not repeat it)
            "loss": total["loss_sum"] / tokens,
            "ce": total["ce_sum"] / tokens,
            "token_acc": total["correct_tokens"] / tokens,
            "digit_acc": total["correct_digits"] / max(total["digits"], 1.0),
            "answer_acc": total["correct_answers"] / max(total["answers"], 1.0),  # every answer token right
            **by_place,
        }
