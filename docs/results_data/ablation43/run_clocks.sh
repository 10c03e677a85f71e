#!/usr/bin/env bash
# The ablation's clock grid (docs/results.md, issue 43 protocol), resumable: start again to continue.
cd "$(dirname "$0")/../../.."
source .venv/bin/activate
exec nice -n 10 python launch/compare.py --config configs/train/tiny_qwen2vl_clock.yaml \
    --losses 'ce,ntil,emd,ntil:loss.digit_alpha=0,ntil:loss.ntil_lambda=0.1,ntil:loss.ntil_lambda=0.03,ntil:loss.ntil_lambda_ramp_steps=500' \
    --lr-grid 1.5e-4,3e-4,6e-4 --select-seed 100 --seeds 0,1,2,3,4,5,6,7 \
    --nproc 1 --jobs 2 --threads 1 --out docs/results_data/ablation43/clocks --runs outputs/ablation43/clocks/runs \
    --test data/clockstd17/test.jsonl \
    model.init=pretrained model.name_or_path=outputs/tiny_qwen2vl_pretrain/export \
    data.train_file=data/clockstd17/train.jsonl data.eval_file=data/clockstd17/val.jsonl \
    train.max_steps=2000 train.micro_batch_size=16 train.global_batch_size=16 train.save_every=0 \
    train.log_every=50 optim.warmup_steps=20 model.freeze_vision_tower=true \
    eval.generate_every=200 eval.generate_samples=200 \
    tracking.uri=sqlite:///$PWD/outputs/ablation43/mlflow.db
