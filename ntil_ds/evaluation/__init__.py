"""Evaluation during and after training: teacher-forced accuracies on the eval split
(:mod:`~ntil_ds.evaluation.teacher_forced`) and greedy answers scored with the task's metrics
(:mod:`~ntil_ds.evaluation.generate`)."""
