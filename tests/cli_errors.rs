//! Bad input through the command line, one row per case: the exit status and a fragment of the message
//! a user sees. 2 is how the command was called (a flag out of range, or one that does not apply), 1 is
//! what went wrong with the files it was given. No row may panic, print an OS error twice, or exit 0
//! having trained nothing.

#[path = "../crates/streambp-train/tests/common/trl_variants.rs"]
#[allow(dead_code)]
mod trl_variants;

use std::path::{Path, PathBuf};

/// One bad input: the arguments (`{dir}` is a fresh directory of the row, `{fixtures}` the test
/// fixtures), the expected exit status and a fragment of stderr.
struct Case {
    args: &'static str,
    status: i32,
    fragment: &'static str,
}

const fn case(args: &'static str, status: i32, fragment: &'static str) -> Case {
    Case {
        args,
        status,
        fragment,
    }
}

/// Every row runs with `--output-dir {dir}/out --no-progress` added (after the subcommand), and on the
/// built-in task unless it says otherwise; `{dir}` holds `prompts.jsonl`, `small.jsonl`, `latin1.jsonl`,
/// `a_file` and a finished 2-step run in `run/` with `run/checkpoint-1` (see `prepare`).
const CASES: &[Case] = &[
    // Sizes of a step.
    case("sft --batch-size 0", 2, "--batch-size 0: must be at least 1"),
    case("dpo --batch-size 0", 2, "--batch-size 0: must be at least 1"),
    case("grpo --batch-size 0", 2, "--batch-size 0: must be at least 1"),
    case("sft --grad-accum 0", 2, "--grad-accum 0: must be at least 1"),
    case("dpo --grad-accum 0", 2, "--grad-accum 0: must be at least 1"),
    case(
        "sft --batch-size 18446744073709551615 --grad-accum 2",
        2,
        "is too large to count",
    ),
    case("sft --batch-size 200 --data {dir}/small.jsonl", 2, "is more than the 5 examples"),
    case("sft --batch-size 100000000", 2, "is more than the 9800 examples"),
    case("dpo --batch-size 20000", 2, "is more than the 9800 pairs"),
    case("grpo --batch-size 9000 --grad-accum 2", 2, "is more than the 9800 prompts"),
    // Length of a run.
    case("sft --max-steps 0", 2, "--max-steps 0: must be at least 1"),
    case("sft --epochs 0", 2, "--epochs 0: must be a number above 0"),
    case("sft --epochs -1", 2, "--epochs -1: must be a number above 0"),
    case("sft --epochs nan", 2, "--epochs NaN: must be a number above 0"),
    case("sft --epochs inf", 2, "--epochs inf: must be a number above 0"),
    // Optimizer.
    case("sft --lr=-1", 2, "--lr -1: must be a number above 0"),
    case("sft --lr 0", 2, "--lr 0: must be a number above 0"),
    case("sft --lr nan", 2, "--lr NaN: must be a number above 0"),
    case("sft --lr inf", 2, "--lr inf: must be a number above 0"),
    case("sft --weight-decay nan", 2, "--weight-decay NaN: must be a number at least 0"),
    case("sft --weight-decay -0.1", 2, "--weight-decay -0.1"),
    case("sft --max-grad-norm -1", 2, "--max-grad-norm -1"),
    case("sft --schedule step", 2, "expected cosine, linear or constant"),
    // Lengths and chunks.
    case("sft --max-length 1", 2, "--max-length 1: must be at least 2"),
    case("sft --chunk 0", 2, "--chunk 0: must be at least 1"),
    case("sft --logits-chunk 0", 2, "--logits-chunk 0: must be at least 1"),
    case("sft --memory-budget 0", 2, "size \"0\" is below 1 byte"),
    case("sft --memory-budget 5XB", 2, "units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"),
    case("sft --memory-budget 1GiB --chunk 8", 2, "--chunk 8: --memory-budget picks the chunks"),
    case(
        "grpo --num-iterations 2 --save-every 3",
        2,
        "--save-every 3: must be a multiple of --num-iterations (2)",
    ),
    case("sft --overflow cut", 2, "expected truncate or skip"),
    case("sft --mode fast", 2, "expected stream, checkpoint or full"),
    case("sft --dtype f16", 2, "--dtype f16: unknown dtype"),
    case("sft --device tpu", 2, "--device tpu: unknown device"),
    // Flags that do not apply.
    case("sft --beta 0.1", 2, "--beta: applies to dpo, grpo, orpo, cpo, kto, rloo and distill only, not sft"),
    case("sft --ref-model x/y", 2, "--ref-model: applies to dpo and kto only, not sft"),
    case("grpo --sft-weight 1", 2, "--sft-weight: applies to dpo only, not grpo"),
    case("dpo --packing", 2, "--packing: applies to sft only"),
    case("grpo --packing", 2, "--packing: applies to sft only"),
    case("sft --lora-alpha 8", 2, "--lora-alpha: needs --lora-r"),
    case("sft --lora-r 0", 2, "--lora-r 0: must be at least 1"),
    case("sft --checkpoint-every 0", 2, "a number of layers (at least 1) or `sqrt`"),
    case("grpo --scale-rewards x", 2, "expected group, batch or none"),
    case("grpo --epsilon-high 0", 2, "--epsilon-high 0: must be a number above 0"),
    case("grpo --sapo-temperature-neg -1", 2, "--sapo-temperature-neg -1: must be a number above 0"),
    case("grpo --loss-type gspo", 2, "expected one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo (GSPO is --importance-sampling-level sequence"),
    case("sft --checkpoint-every x", 2, "a number of layers (at least 1) or `sqrt`"),
    case("sft --host-memory-budget 1GiB", 2, "--host-memory-budget 1073741824: needs --memory-budget"),
    case("sft --lora-r 4 --lora-dropout 1", 2, "--lora-dropout 1: must be in [0, 1)"),
    case("sft --lora-r 4 --lora-target lm_head", 2, "unknown LoRA target \"lm_head\""),
    case("sft --lora-r 4 --adapter {dir}", 2, "brings its own r, alpha and targets"),
    case("sft --merge", 2, "--merge: merges a LoRA adapter"),
    case("sft --adapter {dir}/missing_adapter --max-steps 1", 1, "missing_adapter is neither an existing directory nor a hub id"),
    case("sft --adapter {dir} --max-steps 1", 1, "adapter_config.json"),
    case("dpo --beta 0", 2, "--beta 0: must be a number above 0"),
    case("dpo --beta nan", 2, "--beta NaN"),
    case("grpo --beta -1", 2, "--beta -1: must be a number at least 0"),
    case("dpo --sft-weight -1", 2, "--sft-weight -1"),
    // GRPO.
    // DPO's loss types.
    case("dpo --loss-type foo", 2, "--loss-type foo: unknown DPO loss_type \"foo\" (expected one of sigmoid, hinge, ipo"),
    case("dpo --loss-type exo_pair --max-steps 1", 2, "--loss-type exo_pair: exo_pair needs label_smoothing above 0"),
    case("dpo --label-smoothing 0.1 --max-steps 1", 2, "label_smoothing 0.1 applies to loss_type exo_pair, robust, aot and aot_unpaired, not sigmoid"),
    case("dpo --loss-type robust --label-smoothing 0.5 --max-steps 1", 2, "label_smoothing must be in [0, 0.5), got 0.5"),
    case("dpo --loss-type discopop --discopop-tau -1 --max-steps 1", 2, "discopop_tau must be above 0, got -1"),
    case("dpo --loss-type sigmoid,sft --sft-weight 1 --max-steps 1", 2, "--sft-weight 1: and an sft in --loss-type both weigh the NLL"),
    case("dpo --loss-type aot,ipo --loss-weights 1", 2, "1 loss_weights for 2 loss types: give one weight per type"),
    case("dpo --loss-weights 1", 2, "--loss-weights: needs --loss-type"),
    case("sft --loss-type ipo", 2, "unexpected argument '--loss-type'"),
    // ORPO and CPO.
    case("orpo --loss-type ipo", 2, "unexpected argument '--loss-type'"),
    case("orpo --ref-model {fixtures}/qwen3", 2, "--ref-model: applies to dpo and kto only, not orpo"),
    case("orpo --beta 0", 2, "--beta 0: must be a number above 0"),
    case("orpo --batch-size 20000", 2, "is more than the 9800 pairs"),
    case("cpo --loss-type kto", 2, "--loss-type kto: unknown CPO loss type \"kto\""),
    case(
        "cpo --loss-type hinge --label-smoothing 0.1 --max-steps 1",
        2,
        "label_smoothing applies to loss_type sigmoid and simpo, not hinge",
    ),
    case("cpo --cpo-alpha -1 --max-steps 1", 2, "cpo_alpha -1 is outside [0, ∞)"),
    case("cpo --label-smoothing 0.5 --max-steps 1", 2, "label_smoothing 0.5 is outside [0, 0.5)"),
    case("cpo --sft-weight 1", 2, "--sft-weight: applies to dpo only, not cpo"),
    case("dpo --cpo-alpha 1", 2, "unexpected argument '--cpo-alpha'"),
    // KTO.
    case("kto --loss-type sigmoid", 2, "expected kto or apo_zero_unpaired"),
    case("kto --desirable-weight 0 --max-steps 1", 2, "desirable_weight must be a number above 0, got 0"),
    case("kto --undesirable-weight nan --max-steps 1", 2, "undesirable_weight must be a number above 0"),
    case("kto --sft-weight 1", 2, "--sft-weight: applies to dpo only, not kto"),
    // A setting of one loss type given to another, which would ignore it: refused on the command
    // line, in --config files and in grad's batch files alike.
    case("dpo --discopop-tau 0.1", 2, "discopop_tau applies to loss_type discopop only, not sigmoid"),
    case("dpo --loss-type ipo,sigmoid --discopop-tau 0.1", 2, "discopop_tau applies to loss_type discopop only, not ipo and sigmoid"),
    case("cpo --simpo-gamma 1", 2, "simpo_gamma applies to loss_type simpo only, not sigmoid"),
    case("grpo --loss-type dapo --sapo-temperature-pos 2", 2, "--sapo-temperature-pos 2: applies to loss_type sapo only, not dapo"),
    case("grpo --loss-type sapo --epsilon-high 0.3", 2, "--epsilon-high 0.3: applies to loss_type grpo, bnpo, dr_grpo, dapo, cispo and luspo, not sapo"),
    case("grpo --loss-type cispo --epsilon 0.3", 2, "--epsilon 0.3: applies to loss_type grpo, bnpo, dr_grpo, dapo and luspo, not cispo"),
    case("grpo --config {dir}/sapo_on_dapo.toml", 2, "--sapo-temperature-neg 2: applies to loss_type sapo only, not dapo"),
    case("dpo --config {dir}/discopop_on_ipo.toml", 2, "discopop_tau applies to loss_type discopop only, not ipo"),
    case(
        "grad --model {fixtures}/qwen3 --batch {dir}/sapo_epsilon.json --out {dir}/g.safetensors",
        1,
        "epsilon applies to loss_type grpo, bnpo, dr_grpo, dapo and luspo, not sapo",
    ),
    case(
        "grad --model {fixtures}/qwen3 --batch {dir}/distill.json --out {dir}/g.safetensors",
        1,
        "objective distill needs a teacher (grad --teacher DIR_OR_HUB_ID)",
    ),
    case(
        "grad --model {fixtures}/qwen3 --teacher {fixtures}/qwen3/reward --batch {dir}/distill.json --out {dir}/g.safetensors",
        2,
        "--teacher {fixtures}/qwen3/reward: a reward model (a sequence classifier); a teacher is a causal LM",
    ),
    case(
        "grad --model {fixtures}/qwen3 --teacher {fixtures}/teacher --batch {fixtures}/qwen3/grpo-batch.json --out {dir}/g.safetensors",
        2,
        "applies to objective distill only, not grpo",
    ),
    case(
        "grad --model {fixtures}/qwen3 --teacher {fixtures}/teacher --batch {dir}/distill_beta.json --out {dir}/g.safetensors",
        1,
        "beta 1.5 must be in [0, 1]",
    ),
    case(
        "grad --model {fixtures}/qwen3 --batch {dir}/rloo_groups.json --out {dir}/g.safetensors",
        1,
        "num_generations 3 must be at least 2 and divide the batch's 4 completions",
    ),
    case(
        "grad --model {fixtures}/qwen3 --batch {dir}/rloo_advantages.json --out {dir}/g.safetensors",
        1,
        "bad rloo batch: unknown field `advantages`",
    ),
    case(
        "grad --model {fixtures}/qwen3 --batch {dir}/dpo_discopop.json --out {dir}/g.safetensors",
        1,
        "discopop_tau applies to loss_type discopop only, not hinge",
    ),
    case("sft --data {dir}/bare_cr.jsonl --max-steps 1", 1, "bare_cr.jsonl line 1: several JSON lines separated by a bare carriage return"),
    case(
        "grad --model {fixtures}/qwen3 --batch {dir}/reward_upper.json --out {dir}/g.safetensors",
        1,
        "unknown objective \"REWARD\" (expected sft, dpo, orpo, cpo, kto, reward, grpo, rloo or distill)",
    ),
    case(
        "grad --model {fixtures}/qwen3 --batch {dir}/negative_epsilon_high.json --out {dir}/g.safetensors",
        1,
        "epsilon_high -1 must be a number at least 0",
    ),
    case("reward --data {dir}/huge_margin.jsonl --max-steps 1", 1, "huge_margin.jsonl line 2: \"margin\" must be a number within f32's range"),
    // Held-out rows a job cannot measure say so.
    case("reward --eval-data {dir}/small.jsonl --max-steps 1", 1, "a reward model is measured on held-out preference pairs"),
    case("sft --eval-data {dir}/kto_undesirable.jsonl --max-steps 1", 1, "every held-out row (2) is labelled undesirable"),
    case("kto --eval-data {dir}/kto_label_text.jsonl --max-steps 1", 1, "kto_label_text.jsonl line 1: \"label\" is \"yes\""),
    // KTO's KL baseline needs another row of the micro-batch (TRL refuses it too).
    case("kto --batch-size 1 --grad-accum 4", 2, "--batch-size 1: must be at least 2 for KTO's loss"),
    // Settings that would train nothing, or that the mode has no use for.
    case("dpo --loss-type sigmoid,ipo --loss-weights 0,0", 2, "every loss weight is 0"),
    case("sft --mode full --checkpoint-dir {dir}/ck", 2, "--checkpoint-dir {dir}/ck: stores the layers' checkpoints"),
    case("sft --mode full --checkpoint-every 2", 2, "--checkpoint-every 2: spaces the layers' checkpoints"),
    case("kto --data {dir}/small.jsonl", 1, "expected \"prompt\", \"completion\" and a boolean \"label\""),
    case("dpo --desirable-weight 1", 2, "unexpected argument '--desirable-weight'"),
    // Reward models.
    case("reward --center-rewards-coefficient -1", 2, "--center-rewards-coefficient -1: must be a number at least 0"),
    case("reward --beta 0.1", 2, "--beta: applies to"),
    case("dpo --center-rewards-coefficient 0.01", 2, "unexpected argument '--center-rewards-coefficient'"),
    case("sft --model {fixtures}/qwen3/reward", 2, "is a reward model (a sequence classifier with a score head): sft trains a causal LM"),
    case("grpo --group-size 1", 2, "--group-size 1: must be at least 2"),
    case("grpo --group-size 0", 2, "--group-size 0: must be at least 2"),
    case("grpo --temperature nan", 2, "--temperature NaN: must be a number above 0"),
    case("grpo --temperature -1", 2, "--temperature -1"),
    case("grpo --temperature 0", 2, "--temperature 0: must be a number above 0"),
    case("grpo --top-p 0", 2, "--top-p 0: must be in (0, 1]"),
    case("grpo --top-p 2", 2, "--top-p 2: must be in (0, 1]"),
    case("grpo --num-iterations 0", 2, "--num-iterations 0: must be at least 1"),
    case("grpo --max-new-tokens 0", 2, "--max-new-tokens 0: must be at least 1"),
    case("grpo --max-new-tokens 16", 2, "must be below --max-length (16)"),
    case("grpo --epsilon 0", 2, "--epsilon 0: must be a number above 0"),
    case("grpo --loss-type ppo", 2, "invalid value 'ppo' for '--loss-type <LOSS_TYPE>': expected one of grpo, bnpo, dr_grpo"),
    case("grpo --importance-sampling-level sentence", 2, "invalid value 'sentence' for '--importance-sampling-level <IMPORTANCE_SAMPLING_LEVEL>': expected token or sequence"),
    case("grpo --loss-type vespo --vespo-k-neg -1", 2, "--vespo-k-neg -1: must be a number at least 0"),
    case("grpo --loss-type dapo --vespo-lambda-pos 1", 2, "--vespo-lambda-pos 1: applies to loss_type vespo only, not dapo"),
    case("grpo --off-policy-mask-threshold inf", 2, "--off-policy-mask-threshold inf: must be a number"),
    case("grpo --top-entropy-quantile 1.5", 2, "--top-entropy-quantile 1.5: must be in [0, 1]"),
    case("grpo --entropy-coef nan", 2, "--entropy-coef NaN: must be a number"),
    case("grpo --entropy-target 0.5", 2, "the following required arguments were not provided:\n  --use-adaptive-entropy"),
    case("grpo --use-adaptive-entropy --entropy-coef-min 0.5 --entropy-coef-max 0.1", 2, "--entropy-coef-max 0.1: must be a number at least --entropy-coef-min (0.5)"),
    case("grpo --use-adaptive-entropy --entropy-coef-delta -1", 2, "--entropy-coef-delta -1: must be a number at least 0"),
    case("rloo --entropy-coef 0.1", 2, "unexpected argument '--entropy-coef' found"),
    case("rloo --group-size 1", 2, "--group-size 1: must be at least 2"),
    case("rloo --beta -0.1", 2, "--beta -0.1: must be a number at least 0"),
    case("rloo --loss-type dapo", 2, "unexpected argument '--loss-type' found"),
    case("rloo --sft-weight 1", 2, "--sft-weight: applies to dpo only, not rloo"),
    case("rloo --data {dir}/prompts.jsonl", 2, "RLOO needs at least one --reward"),
    case("distill --beta 1.5", 2, "--beta 1.5: must be in [0, 1]"),
    case("distill --group-size 2", 2, "unexpected argument '--group-size' found"),
    case("distill --reward exact:answer", 2, "unexpected argument '--reward' found"),
    case("distill --temperature 0", 2, "--temperature 0: must be a number above 0"),
    case("distill --max-new-tokens 16", 2, "--max-new-tokens 16: must be below --max-length (16)"),
    case("distill --teacher {dir}/a_file", 2, "a_file: a file; --teacher takes a model directory or a hub id"),
    case("grpo --reward length:3", 2, "--reward length:3: unknown reward"),
    case("grpo --reward format:(", 2, "not a valid regular expression"),
    case("grpo --reward format:", 2, "--reward format:: format: needs a pattern"),
    case("grpo --data {dir}/prompts.jsonl", 2, "GRPO needs at least one --reward"),
    case(
        "grpo --reward exact:answer --max-steps 1",
        1,
        "line 1: no \"answer\" column, which the reward exact:answer reads",
    ),
    case(
        "grpo --max-length 6 --overflow skip --max-steps 1",
        1,
        "no prompts left to train on",
    ),
    // Answers of GRPO's exact reward that could only ever score 0.
    case(
        "grpo --data {dir}/null_answer.jsonl --reward exact:answer --max-steps 1",
        1,
        "null_answer.jsonl line 2: the \"answer\" column (read by the reward exact:answer) holds null",
    ),
    case(
        "grpo --data {dir}/bool_answer.jsonl --reward exact:answer --max-steps 1",
        1,
        "holds the boolean true; it needs a string, a number or a list of those",
    ),
    // Preference pairs with nothing to prefer.
    case(
        "dpo --data {dir}/same_pairs.jsonl --max-steps 1",
        1,
        "no pairs left to train on: 2 with chosen equal to rejected (first at {dir}/same_pairs.jsonl line 1)",
    ),
    // Negative numbers are values, refused by the flag's own check.
    case("sft --lora-r -1", 2, "invalid value '-1' for '--lora-r <LORA_R>'"),
    case("sft --batch-size -1", 2, "invalid value '-1' for '--batch-size <BATCH_SIZE>'"),
    case("sft --lr -1e-5", 2, "--lr -0.00001: must be a number above 0"),
    // LoRA ranks past what the model's projections can hold.
    case("sft --lora-r 100000 --max-steps 1", 2, "--lora-r 100000: must be at most 64 for this model"),
    case("sft --lora-r 65 --lora-target q_proj,k_proj --max-steps 1", 2, "--lora-r 65: must be at most 64"),
    case(
        "grad --model {fixtures}/qwen3 --batch {fixtures}/qwen3-batch.json --out {dir}/g.safetensors --adapter {dir}/run/final --lora-r 8",
        2,
        "--adapter {dir}/run/final: brings its own r, alpha and targets: give it without --lora-r",
    ),
    case("sft --memory-budget 99999999999999TiB", 2, "size \"99999999999999TiB\" is too large"),
    case("sft --memory-budget 0.5B", 2, "size \"0.5B\" is below 1 byte"),
    case("sft --packing --data {dir}/small.jsonl --batch-size 2", 2, "is more than the 1 packed rows of {dir}/small.jsonl"),
    case("sft --data {dir}/null_completion.jsonl", 1, "the row has \"completion\" (null), \"prompt\""),
    // Splits of a single file.
    case("sft --data {dir}/small.jsonl --split test", 2, "--split test: applies to --data naming a directory or a hub dataset"),
    case("sft --split nosuch", 2, "--split nosuch: applies to --data naming a directory"),
    case(
        "sft --data {dir}/small.jsonl --eval-data {dir}/small.jsonl --eval-split validation",
        2,
        "--eval-split validation: applies to --eval-data naming a directory or a hub dataset",
    ),
    // Config files.
    case("sft --config {dir}/nested.toml", 2, "nested.toml: config = \"other.toml\": a config file cannot name another"),
    case("sft --config {dir}/bad_type.toml", 2, "note: --batch-size (set in {dir}/bad_type.toml)"),
    case("sft --config {dir}/bad_range.toml", 2, "--lr (set in {dir}/bad_range.toml): --lr -1: must be a number above 0"),
    // Files.
    case("sft --data {dir}/missing.jsonl", 2, "--data {dir}/missing.jsonl: no such file"),
    case("sft --data {dir}/final_is_file", 1, "final_is_file: holds no .jsonl, .json or .parquet file"),
    case("sft --data {dir}/splits --split validation", 1, "no split \"validation\" (splits found: \"test\", \"train\")"),
    case("sft --data {dir}/small.jsonl --data-config en", 2, "--data-config en: applies to --data naming a directory or a hub dataset"),
    case("sft --eval-split test", 2, "--eval-split test: needs --eval-data, or --data naming a directory"),
    case("sft --split=", 2, "--split: a name, not empty"),
    case("sft --data {dir}/small.jsonl --eval-every 2", 2, "--eval-every 2: needs held-out data: give --eval-data"),
    case("sft --eval-every=-1", 2, "invalid value '-1' for '--eval-every <EVAL_EVERY>'"),
    case("dpo --dataset-text-field body", 2, "--dataset-text-field: applies to sft only"),
    case("sft --data not/a/dataset/id", 2, "no such file or directory, and not a hub dataset id"),
    case("sft --eval-data {dir}/missing.jsonl", 2, "--eval-data {dir}/missing.jsonl: no such file"),
    case("sft --eval-data {dir}/empty_prompt.jsonl --max-steps 1", 1, "empty_prompt.jsonl line 1: the prompt is empty"),
    case("grpo --data {dir}/empty_prompt.jsonl --reward format:x", 1, "empty_prompt.jsonl line 1: the prompt is empty"),
    case("sft --data {dir}/latin1.jsonl --max-steps 1", 1, "latin1.jsonl line 2: not valid UTF-8"),
    case("sft --config {dir}/missing.toml", 2, "missing.toml: no such file"),
    // Input files that are not regular files are refused before a byte is read (a device would
    // fill the memory, a pipe with no writer would block).
    case("sft --config /dev/zero", 2, "/dev/zero: a character device, not a regular file"),
    case("sft --config {dir}/pipe", 2, "pipe: a named pipe, not a regular file"),
    case("sft --config {dir}/splits", 2, "splits: a directory, not a regular file"),
    case("sft --data /dev/zero --max-steps 1", 1, "/dev/zero: a character device, not a regular file"),
    case("sft --eval-data {dir}/pipe --max-steps 1", 1, "pipe: a named pipe, not a regular file"),
    case(
        "grad --model {fixtures}/qwen3 --batch /dev/zero --out {dir}/g.safetensors",
        2,
        "--batch /dev/zero: a character device, not a regular file",
    ),
    case(
        "grad --model {fixtures}/qwen3 --batch {dir}/pipe --out {dir}/g.safetensors",
        2,
        "pipe: a named pipe, not a regular file",
    ),
    case("sft --model models/x --max-steps 1", 1, "no directory models/x under"),
    case("sft --model= --max-steps 1", 1, "--model is empty: give a directory or a hub id"),
    case("sft --adapter= --max-steps 1", 1, "--adapter is empty"),
    case("sft --model {dir}/a_file", 1, "is a file; --model takes a directory or a hub id"),
    case(
        "dpo --ref-model {fixtures}/qwen3 --max-steps 1",
        1,
        "--ref-model {fixtures}/qwen3: its vocabulary has 96 tokens, the policy's 16",
    ),
    // Output directory.
    case("sft --output-dir {dir}/a_file", 2, "exists and is not a directory"),
    case(
        "sft --output-dir {dir}/a_file/sub",
        1,
        "cannot create the output directory {dir}/a_file/sub",
    ),
    case("sft --output-dir {dir}/final_is_file", 2, "final exists and is not a directory"),
    case("sft --output-dir {dir}/locked", 2, "is in use by another run"),
    case(
        "sft --output-dir {dir}/run --max-steps 1",
        2,
        "--output-dir {dir}/run: holds an earlier run (checkpoint-1, checkpoint-2, final): give --resume",
    ),
    case("grpo --group-size 100000000", 2, "--group-size 100000000: must be at most 1024"),
    // Resuming.
    case("sft --resume {dir}/missing", 2, "--resume {dir}/missing: no such directory"),
    case("sft --resume {dir}/run/final", 2, "is not a resumable checkpoint"),
    case(
        "sft --resume {dir}/run/checkpoint-1 --max-steps 1 --batch-size 4",
        1,
        "nothing left to train (raise --max-steps)",
    ),
    case(
        "sft --resume {dir}/run/checkpoint-1 --max-steps 2 --batch-size 4 --data {dir}/small.jsonl",
        1,
        "cannot resume from {dir}/run/checkpoint-1: data: \"9800 items, fingerprint",
    ),
    case(
        "sft --resume {dir}/run/checkpoint-1 --max-steps 2 --batch-size 8",
        1,
        "--batch-size: 4 in the checkpoint's run, 8 now",
    ),
    case(
        "sft --resume {dir}/run/checkpoint-1 --max-steps 2 --batch-size 4 --max-length 8",
        1,
        "\" in the checkpoint's run, \"9800 items, fingerprint",
    ),
    case(
        "sft --resume {dir}/run/checkpoint-1 --model {fixtures}/qwen3 --max-steps 2 --batch-size 4",
        1,
        "--model: \"built-in (random)\" in the checkpoint's run",
    ),
    case(
        "dpo --resume {dir}/run/checkpoint-1 --max-steps 2 --batch-size 4",
        1,
        "recipe: \"sft\" in the checkpoint's run, \"dpo\" now",
    ),
    // grad.
    case(
        "grad --model {fixtures}/qwen3 --batch {fixtures}/qwen3-batch.json --out {dir}/no/g.safetensors",
        2,
        "its directory {dir}/no does not exist",
    ),
    case(
        "grad --model {fixtures}/qwen3 --batch {fixtures}/qwen3-batch.json --out {dir} --chunk 0",
        2,
        "--chunk 0: must be at least 1",
    ),
    case(
        "grad --model {fixtures}/qwen3 --batch {dir}/missing.json --out {dir}/g.safetensors",
        2,
        "--batch {dir}/missing.json: no such file",
    ),
    case(
        "grad --model {fixtures}/qwen3 --batch {fixtures}/qwen3-batch.json --out {dir}/g.st --dtype f16",
        2,
        "--dtype f16: unknown dtype",
    ),
    case(
        "grad --model {fixtures}/qwen3 --batch {fixtures}/qwen3-batch.json --out {dir}/g.st --ref-model {fixtures}/qwen3/lora",
        1,
        "qwen3/lora holds a PEFT adapter, not a model",
    ),
    // A model where an adapter goes and the other way round.
    case(
        "sft --model {fixtures}/qwen3/lora --max-steps 1",
        1,
        "qwen3/lora holds a PEFT adapter, not a model: give it as --adapter",
    ),
    case(
        "dpo --model {dir}/run/final --ref-model {fixtures}/qwen3/lora --max-steps 1",
        1,
        "qwen3/lora holds a PEFT adapter, not a model",
    ),
    case(
        "sft --adapter {fixtures}/qwen3 --max-steps 1",
        1,
        "qwen3 holds a model, not a PEFT adapter (no adapter_config.json): give it as --model",
    ),
    // Config values of the wrong kind for their flag.
    case("sft --config {dir}/switch_text.toml", 2, "switch_text.toml: packing = \"yes\": --packing is a switch, set to true or false"),
    case("sft --config {dir}/switch_number.toml", 2, "switch_number.toml: no_progress = 1: --no-progress is a switch"),
    case("sft --config {dir}/value_bool.toml", 2, "value_bool.toml: lr = false: --lr takes a value, not true or false"),
    case("sft --config {dir}/unknown_false.toml", 2, "note: --pakcing (set in {dir}/unknown_false.toml)"),
    case("dpo --config {dir}/value_true.toml", 2, "value_true.toml: ref-model = true: --ref-model takes a value"),
    // Held-out rows longer than --max-length with their answers (by the answer, by the prompt).
    case(
        "sft --eval-data {dir}/long_eval.jsonl --max-steps 1",
        1,
        "long_eval.jsonl: every held-out row (2) has more than --max-length 16 tokens with its answer",
    ),
    case(
        "grpo --eval-data {dir}/long_eval.jsonl --max-steps 1 --max-length 24 --max-new-tokens 4",
        1,
        "every held-out row (2) has more than --max-length 24 tokens",
    ),
    // A null or missing side of a preference pair, with what the row has.
    case(
        "dpo --data {dir}/null_rejected.jsonl --max-steps 1",
        1,
        "null_rejected.jsonl line 1: expected \"chosen\" and \"rejected\" (and \"prompt\" unless both hold it), no \"rejected\"; the row has \"chosen\", \"prompt\", \"rejected\" (null)",
    ),
    case(
        "dpo --data {dir}/small.jsonl --max-steps 1",
        1,
        "no \"chosen\"; the row has \"completion\", \"prompt\"",
    ),
    // Each model role has the head it needs.
    case("reward --model {dir}/token_cls --max-steps 1", 1, "architecture Qwen3ForTokenClassification: streambp trains causal LMs"),
    case("sft --model {dir}/token_cls --max-steps 1", 1, "architecture Qwen3ForTokenClassification"),
    case("dpo --ref-model {dir}/reward_run/final --max-steps 1", 1, "--ref-model {dir}/reward_run/final: a reward model (a sequence classifier), not a causal LM"),
    case("kto --ref-model {dir}/reward_run/final --max-steps 1", 1, "--ref-model {dir}/reward_run/final: a reward model"),
    case(
        "grad --model {fixtures}/qwen3 --batch {fixtures}/qwen3/dpo-batch.json --ref-model {fixtures}/qwen3/reward --out {dir}/g.safetensors",
        1,
        "a reward model (a sequence classifier), not a causal LM",
    ),
    // The margins a reward model trains on changed since the checkpoint.
    case(
        "reward --resume {dir}/reward_run/checkpoint-1 --data {dir}/margins.jsonl --max-steps 2 --batch-size 2",
        1,
        "cannot resume from {dir}/reward_run/checkpoint-1: data:",
    ),
    // A reference whose weights changed under the same path since the checkpoint.
    case(
        "dpo --resume {dir}/dpo_run/checkpoint-1 --model {dir}/run/final --ref-model {dir}/reference --max-steps 2 --batch-size 4",
        1,
        "cannot resume from {dir}/dpo_run/checkpoint-1: --ref-model: \"weights:",
    ),
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn train(dir: &Path, args: &[String]) -> (i32, String) {
    let out = streambp_testkit::command(env!("CARGO_BIN_EXE_streambp-train"))
        .args(args)
        .env("RUST_LOG", "warn")
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", dir.join("hf-home"))
        .output()
        .expect("the trainer runs");
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    (out.status.code().unwrap_or(-1), text)
}

/// The files the rows read.
fn prepare(dir: &Path) {
    std::fs::write(dir.join("prompts.jsonl"), "{\"prompt\": \"1+2=\"}\n").unwrap();
    let small: String = (0..5)
        .map(|i| {
            format!(
                "{{\"prompt\": \"{i}+1=\", \"completion\": \"{}\"}}\n",
                i + 1
            )
        })
        .collect();
    std::fs::write(dir.join("small.jsonl"), &small).unwrap();
    let mut latin1 = b"{\"text\": \"1+1=2\"}\n{\"text\": \"caf".to_vec();
    latin1.extend([0xe9, b'"', b'}', b'\n']);
    std::fs::write(dir.join("latin1.jsonl"), latin1).unwrap();
    std::fs::write(dir.join("a_file"), "not a directory").unwrap();
    std::fs::create_dir_all(dir.join("splits")).unwrap();
    std::fs::write(dir.join("splits/train.jsonl"), &small).unwrap();
    std::fs::write(dir.join("splits/test.jsonl"), small).unwrap();
    std::fs::write(
        dir.join("empty_prompt.jsonl"),
        "{\"prompt\": \"\", \"completion\": \"1\"}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("null_answer.jsonl"),
        "{\"prompt\": \"1+1=\", \"answer\": 2}\n{\"prompt\": \"1+2=\", \"answer\": null}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("bool_answer.jsonl"),
        "{\"prompt\": \"1+1=\", \"answer\": true}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("same_pairs.jsonl"),
        "{\"prompt\": \"1+1=\", \"chosen\": \"2\", \"rejected\": \"2\"}\n\
         {\"chosen\": \"1+2=3\", \"rejected\": \"1+2=3\"}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("null_completion.jsonl"),
        "{\"prompt\": \"1+1=\", \"completion\": null}\n",
    )
    .unwrap();
    std::fs::write(dir.join("nested.toml"), "config = \"other.toml\"\n").unwrap();
    std::fs::write(dir.join("switch_text.toml"), "packing = \"yes\"\n").unwrap();
    std::fs::write(dir.join("switch_number.toml"), "no_progress = 1\n").unwrap();
    std::fs::write(dir.join("value_bool.toml"), "lr = false\n").unwrap();
    std::fs::write(dir.join("unknown_false.toml"), "pakcing = false\n").unwrap();
    std::fs::write(dir.join("value_true.toml"), "ref-model = true\n").unwrap();
    let digits = "7".repeat(40);
    std::fs::write(
        dir.join("long_eval.jsonl"),
        format!(
            "{{\"prompt\": \"1+1=\", \"completion\": \"{digits}\"}}\n\
             {{\"prompt\": \"{digits}+1=\", \"completion\": \"8\"}}\n"
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("null_rejected.jsonl"),
        "{\"prompt\": \"1+1=\", \"chosen\": \"2\", \"rejected\": null}\n",
    )
    .unwrap();
    std::fs::write(dir.join("bad_type.toml"), "batch_size = \"many\"\n").unwrap();
    std::fs::write(dir.join("bad_range.toml"), "lr = -1\n").unwrap();
    std::fs::write(
        dir.join("kto_undesirable.jsonl"),
        "{\"prompt\": \"1+1=\", \"completion\": \"3\", \"label\": false}\n\
         {\"prompt\": \"1+2=\", \"completion\": \"4\", \"label\": false}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("kto_label_text.jsonl"),
        "{\"prompt\": \"1+1=\", \"completion\": \"2\", \"label\": \"yes\"}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("sapo_on_dapo.toml"),
        "loss_type = \"dapo\"\nsapo_temperature_neg = 2\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("discopop_on_ipo.toml"),
        "loss_type = \"ipo\"\ndiscopop_tau = 0.1\n",
    )
    .unwrap();
    let edited = |fixture: &str, to: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let text = std::fs::read_to_string(fixtures().join(fixture)).unwrap();
        let mut batch: serde_json::Value = serde_json::from_str(&text).unwrap();
        edit(&mut batch);
        std::fs::write(dir.join(to), batch.to_string()).unwrap();
    };
    std::fs::write(
        dir.join("bare_cr.jsonl"),
        "{\"prompt\": \"1+1=\", \"completion\": \"2\"}\r{\"prompt\": \"1+2=\", \"completion\": \"3\"}\r",
    )
    .unwrap();
    std::fs::write(
        dir.join("huge_margin.jsonl"),
        "{\"prompt\": \"1+1=\", \"chosen\": \"2\", \"rejected\": \"3\", \"margin\": 1}\n\
         {\"prompt\": \"1+2=\", \"chosen\": \"3\", \"rejected\": \"4\", \"margin\": 1e300}\n",
    )
    .unwrap();
    edited("qwen3/dpo-batch.json", "reward_upper.json", &|j| {
        j["objective"] = "REWARD".into();
    });
    edited(
        "qwen3/grpo-batch.json",
        "negative_epsilon_high.json",
        &|j| {
            j["epsilon_high"] = (-1.0).into();
        },
    );
    edited("qwen3/grpo-batch.json", "sapo_epsilon.json", &|j| {
        j["loss_type"] = "sapo".into();
        j["epsilon"] = 0.3.into();
    });
    // RLOO: the GRPO batch with rewards, in groups of 3 that do not divide its 4 completions; and
    // with advantages as GRPO's (a field RLOO does not read).
    let as_rloo = |j: &mut serde_json::Value, g: usize| {
        let o = j.as_object_mut().unwrap();
        o.remove("max_completion_length");
        o.insert("objective".into(), "rloo".into());
        o.insert("rewards".into(), serde_json::json!([1.0, 0.0, 0.5, 0.2]));
        o.insert("num_generations".into(), g.into());
    };
    edited("qwen3/grpo-batch.json", "rloo_groups.json", &|j| {
        as_rloo(j, 3);
        j.as_object_mut().unwrap().remove("advantages");
    });
    edited("qwen3/grpo-batch.json", "rloo_advantages.json", &|j| {
        as_rloo(j, 2)
    });
    // Distillation: the GRPO batch's rows (as the parity tests make them), and one with a
    // divergence beyond the JSD family.
    let distill = trl_variants::distill_variants().remove(0);
    let as_distill = |j: &mut serde_json::Value| (distill.edit)(j);

    edited("qwen3/grpo-batch.json", "distill.json", &as_distill);
    edited("qwen3/grpo-batch.json", "distill_beta.json", &|j| {
        as_distill(j);
        j["beta"] = 1.5.into();
    });
    edited("qwen3/dpo-batch.json", "dpo_discopop.json", &|j| {
        j["loss_type"] = "hinge".into();
        j["discopop_tau"] = 0.1.into();
    });
    let pipe = std::process::Command::new("mkfifo")
        .arg(dir.join("pipe"))
        .status();
    assert!(pipe.is_ok_and(|s| s.success()), "mkfifo");
    std::fs::create_dir_all(dir.join("final_is_file")).unwrap();
    std::fs::write(dir.join("final_is_file/final"), "").unwrap();
    let args: Vec<String> =
        "sft --max-steps 2 --save-every 1 --batch-size 4 --no-progress --output-dir"
            .split(' ')
            .map(String::from)
            .chain([dir.join("run").display().to_string()])
            .collect();
    let (status, text) = train(dir, &args);
    assert_eq!(status, 0, "{text}");
    // A DPO run against a reference whose weights are then replaced at the same path.
    let run = |line: String| {
        let args: Vec<String> = line.split(' ').map(String::from).collect();
        let (status, text) = train(dir, &args);
        assert_eq!(status, 0, "{text}");
    };
    let d = dir.display();
    copy_dir(&dir.join("run/final"), &dir.join("reference"));
    run(format!(
        "dpo --model {d}/run/final --ref-model {d}/reference --max-steps 2 --save-every 1 \
         --batch-size 4 --no-progress --output-dir {d}/dpo_run"
    ));
    std::fs::remove_dir_all(dir.join("reference")).unwrap();
    copy_dir(&dir.join("run/checkpoint-1"), &dir.join("reference"));
    // A reward run on pairs with margins, whose margin column then changes in place.
    let pairs = |margin: f64| -> String {
        (0..4)
            .map(|i| {
                format!(
                    "{{\"prompt\": \"{i}+1=\", \"chosen\": \"{}\", \"rejected\": \"9\", \"margin\": {margin}}}\n",
                    i + 1
                )
            })
            .collect()
    };
    std::fs::write(dir.join("margins.jsonl"), pairs(0.5)).unwrap();
    run(format!(
        "reward --data {d}/margins.jsonl --max-steps 2 --save-every 1 --batch-size 2 --no-progress \
         --output-dir {d}/reward_run"
    ));
    std::fs::write(dir.join("margins.jsonl"), pairs(3.0)).unwrap();
    // A model with a token classifier's head.
    copy_dir(&fixtures().join("qwen3"), &dir.join("token_cls"));
    let config = std::fs::read_to_string(dir.join("token_cls/config.json")).unwrap();
    let config = config.replace("Qwen3ForCausalLM", "Qwen3ForTokenClassification");
    std::fs::write(dir.join("token_cls/config.json"), config).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

#[test]
fn every_bad_input_is_a_clear_error_and_nothing_panics() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    prepare(dir);
    // Another run holds this directory's lock.
    std::fs::create_dir_all(dir.join("locked")).unwrap();
    let held = std::fs::File::create(dir.join("locked/.lock")).unwrap();
    held.try_lock().unwrap();

    let fill = |s: &str| {
        s.replace("{dir}", &dir.display().to_string())
            .replace("{fixtures}", &fixtures().display().to_string())
    };
    let mut failures = Vec::new();
    for (i, row) in CASES.iter().enumerate() {
        let mut args: Vec<String> = fill(row.args).split(' ').map(String::from).collect();
        if args[0] != "grad" {
            let out = dir.join(format!("out-{i}")).display().to_string();
            let mut extra = vec!["--no-progress".to_string()];
            if !row.args.contains("--output-dir") {
                extra.extend(["--output-dir".into(), out]);
            }
            args.splice(1..1, extra);
        }
        let (status, text) = train(dir, &args);
        let fragment = fill(row.fragment);
        let problems = [
            (status != row.status).then(|| format!("exit {status}, expected {}", row.status)),
            (!text.contains(&fragment)).then(|| format!("no {fragment:?}")),
            text.contains("panicked").then(|| "panicked".to_string()),
            (text.matches("os error").count() > 1).then(|| "an OS error printed twice".into()),
            // A failed run leaves no output directory behind that it created and wrote nothing to.
            dir.join(format!("out-{i}"))
                .exists()
                .then(|| "left its empty output directory".into()),
        ];
        for p in problems.into_iter().flatten() {
            failures.push(format!("{}: {p}\n{text}", row.args));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n---\n"));
    drop(held);
}

/// Without `--output-dir` each run writes into a new `runs/<job>-<date-time>`, so the README's first
/// command runs again as it is; the last step's checkpoint extends a finished run, in its directory.
#[test]
fn the_built_in_run_can_run_again() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    let run = |args: &str| {
        let out = streambp_testkit::command(env!("CARGO_BIN_EXE_streambp-train"))
            .args(args.split(' '))
            .current_dir(dir)
            .env("RUST_LOG", "warn")
            .env("HF_HUB_OFFLINE", "1")
            .env("HF_HOME", dir.join("hf-home"))
            .output()
            .expect("the trainer runs");
        let text = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args}: {text}");
    };
    let runs = || -> Vec<PathBuf> {
        let mut runs: Vec<PathBuf> = std::fs::read_dir(dir.join("runs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        runs.sort();
        runs
    };
    for _ in 0..2 {
        run("sft --max-steps 2 --batch-size 4 --no-progress");
    }
    let made = runs();
    assert_eq!(made.len(), 2, "{made:?}");
    for run_dir in &made {
        let name = run_dir.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("sft-2"), "{name}");
        assert!(run_dir.join("final").is_dir(), "{name}");
        // Without --save-every, the last step's checkpoint alone.
        assert!(run_dir.join("checkpoint-2").is_dir(), "{name}");
        assert!(!run_dir.join("checkpoint-1").exists(), "{name}");
    }
    // The last step's checkpoint extends the finished run, in its own directory.
    let checkpoint = made[0].join("checkpoint-2");
    run(&format!(
        "sft --resume {} --max-steps 3 --batch-size 4 --no-progress",
        checkpoint.display()
    ));
    assert_eq!(runs(), made, "the resumed run went on in its own directory");
    assert!(made[0].join("checkpoint-3").is_dir());
}

/// `--epochs` sets the length of a built-in run too (which otherwise has a default --max-steps), and
/// a user's own hidden files in the output directory survive the cleanup of interrupted saves.
#[test]
fn epochs_set_the_length_and_user_files_survive() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    let out = dir.join("out");
    std::fs::create_dir_all(out.join(".cache.tmp-42")).unwrap();
    std::fs::write(out.join(".notes.tmp-1"), "mine").unwrap();
    std::fs::write(out.join(".env.old-2024"), "mine").unwrap();
    let args = format!(
        "sft --no-progress --epochs 0.01 --batch-size 49 --output-dir {}",
        out.display()
    );
    let args: Vec<String> = args.split(' ').map(String::from).collect();
    let (status, text) = train(dir, &args);
    assert_eq!(status, 0, "{text}");
    assert!(
        text.contains("sft: 2 steps"),
        "9800 × 0.01 / 49 = 2 steps: {text}"
    );
    for kept in [".cache.tmp-42", ".notes.tmp-1", ".env.old-2024"] {
        assert!(out.join(kept).exists(), "{kept} was removed");
    }
}

/// The warnings that let a run go on: text the tokenizer cannot spell, a length beyond the model's
/// positions, a warmup that outlasts the run, held-out rows too long to score.
#[test]
fn questionable_settings_warn_and_train() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    std::fs::write(
        dir.join("accents.jsonl"),
        "{\"prompt\": \"1+1=\", \"completion\": \"2\"}\n{\"prompt\": \"é+1=\", \"completion\": \"2\"}\n",
    )
    .unwrap();
    // One held-out row whose answer outruns --max-length.
    std::fs::write(
        dir.join("held_out.jsonl"),
        format!(
            "{{\"prompt\": \"1+1=\", \"completion\": \"2\"}}\n\
             {{\"prompt\": \"1+1=\", \"completion\": \"{}\"}}\n",
            "2".repeat(5000)
        ),
    )
    .unwrap();
    let args = format!(
        "sft --no-progress --max-steps 2 --warmup-steps 5 --batch-size 2 --max-length 4096 --data {} \
         --eval-data {} --output-dir {}",
        dir.join("accents.jsonl").display(),
        dir.join("held_out.jsonl").display(),
        dir.join("out").display()
    );
    let args: Vec<String> = args.split(' ').map(String::from).collect();
    let (status, text) = train(dir, &args);
    assert_eq!(status, 0, "{text}");
    for warning in [
        "outside the tokenizer's vocabulary",
        "accents.jsonl line 2",
        "above the model's max_position_embeddings",
        "the warmup lasts the whole run",
        "held-out rows longer than --max-length with their answers are left out of the accuracy",
        "left_out=1 kept=1",
    ] {
        assert!(text.contains(warning), "no {warning:?} in\n{text}");
    }
}

/// Every loss-type-specific setting, given to each loss type that does not read it (as the
/// objectives describe their types: [`LossSettings`]), is refused naming the types that read it: on
/// the command line, in `--config` files and in `grad`'s batch files.
#[test]
fn every_unread_loss_setting_is_refused() {
    use streambp_objectives::{CpoLossType, DpoLossType, GrpoLossType, LossSettings};
    /// `(loss type, setting, value)` for every setting a type does not read.
    fn unread<T: LossSettings>() -> Vec<(&'static str, &'static str, f64)> {
        let value = |setting: &str| match setting {
            "label_smoothing" => 0.1,
            "sapo_temperature_pos" | "sapo_temperature_neg" => 2.0,
            _ => 0.3,
        };
        T::TYPES
            .iter()
            .flat_map(|t| T::SETTINGS.iter().map(move |s| (*t, *s)))
            .filter(|(t, s)| !t.reads(s))
            .map(|(t, s)| (t.type_name(), s, value(s)))
            .collect()
    }
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    let mut failures = Vec::new();
    let mut refused = |args: Vec<String>, status: i32, setting: &str| {
        let (got, text) = train(dir, &args);
        // The setting by TRL's name, or by its flag's.
        let named = text.contains(setting) || text.contains(&setting.replace('_', "-"));
        let said = text.contains("applies to loss_type") && named;
        if got != status || !said || text.contains("panicked") {
            failures.push(format!("{}: exit {got}\n{text}", args.join(" ")));
        }
    };
    let jobs = [
        ("dpo", unread::<DpoLossType>()),
        ("cpo", unread::<CpoLossType>()),
        ("grpo", unread::<GrpoLossType>()),
    ];
    let mut count = 0;
    for (job, cases) in &jobs {
        for (loss_type, setting, value) in cases {
            let flag = format!("--{}", setting.replace('_', "-"));
            let args = format!("{job} --no-progress --loss-type {loss_type} {flag} {value}");
            let mut args: Vec<String> = args.split(' ').map(String::from).collect();
            args.extend(["--output-dir".into(), dir.join("out").display().to_string()]);
            refused(args, 2, setting);
            // The same in a --config file.
            let file = dir.join("run.toml");
            let toml = format!("loss_type = \"{loss_type}\"\n{setting} = {value}\n");
            std::fs::write(&file, toml).unwrap();
            let args = format!("{job} --no-progress --config {}", file.display());
            let mut args: Vec<String> = args.split(' ').map(String::from).collect();
            args.extend(["--output-dir".into(), dir.join("out").display().to_string()]);
            refused(args, 2, setting);
            count += 2;
        }
    }
    // The same settings in grad's batch files.
    for (job, fixture) in [("dpo", "dpo-batch.json"), ("grpo", "grpo-batch.json")] {
        let cases = &jobs.iter().find(|(j, _)| *j == job).unwrap().1;
        for (loss_type, setting, value) in cases {
            let text = std::fs::read_to_string(fixtures().join("qwen3").join(fixture)).unwrap();
            let mut batch: serde_json::Value = serde_json::from_str(&text).unwrap();
            batch["loss_type"] = (*loss_type).into();
            batch[*setting] = (*value).into();
            if *setting != "epsilon" {
                // The fixture's epsilon, which cispo and sapo do not read, is not the case here.
                batch.as_object_mut().unwrap().remove("epsilon");
            }
            let file = dir.join("batch.json");
            std::fs::write(&file, batch.to_string()).unwrap();
            let args = format!(
                "grad --model {} --batch {} --out {}",
                fixtures().join("qwen3").display(),
                file.display(),
                dir.join("g.safetensors").display()
            );
            refused(args.split(' ').map(String::from).collect(), 1, setting);
            count += 1;
        }
    }
    assert!(count > 80, "{count} cases");
    assert!(failures.is_empty(), "{}", failures.join("\n---\n"));
}

/// Each job's `--help` groups its flags as the guides do: data, model, objective, optimisation,
/// memory, output (a job without objective flags of its own has no such group).
#[test]
fn every_jobs_help_groups_its_flags() {
    let root = tempfile::tempdir().unwrap();
    for job in [
        "sft", "dpo", "kto", "orpo", "cpo", "reward", "grpo", "rloo", "distill", "grad",
    ] {
        let (status, text) = train(root.path(), &[job.to_string(), "--help".to_string()]);
        assert_eq!(status, 0, "{job}: {text}");
        let at = |heading: &str| text.find(&format!("\n{heading}:\n"));
        let groups: Vec<usize> = [
            "Data",
            "Model",
            "Objective",
            "Optimisation",
            "Memory",
            "Output",
        ]
        .iter()
        .filter_map(|h| at(h))
        .collect();
        assert!(groups.len() >= 5, "{job}: groups missing in\n{text}");
        assert!(
            groups.windows(2).all(|w| w[0] < w[1]),
            "{job}: groups out of order\n{text}"
        );
        // Every flag sits in a group: none is left under clap's "Options".
        let options = text.split("\nOptions:\n").nth(1).unwrap_or("");
        let loose: Vec<&str> = options
            .lines()
            .take_while(|l| !l.ends_with(':'))
            .filter(|l| l.trim_start().starts_with("--") && !l.contains("--help"))
            .collect();
        assert!(loose.is_empty(), "{job}: ungrouped {loose:?}");
    }
}

/// KTO's held-out rows are scored by their desirable completions only: an undesirable completion
/// is no answer to match, whichever job reads the rows.
#[test]
fn labelled_held_out_rows_score_their_desirable_answers() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    std::fs::write(
        dir.join("labelled.jsonl"),
        "{\"prompt\": \"1+1=\", \"completion\": \"2\", \"label\": true}\n\
         {\"prompt\": \"1+1=\", \"completion\": \"3\", \"label\": false}\n\
         {\"prompt\": \"2+2=\", \"completion\": \"4\", \"label\": true}\n",
    )
    .unwrap();
    for job in ["kto", "sft"] {
        let args = format!(
            "{job} --no-progress --max-steps 1 --batch-size 2 --eval-data {} --output-dir {}",
            dir.join("labelled.jsonl").display(),
            dir.join(job).display()
        );
        let args: Vec<String> = args.split(' ').map(String::from).collect();
        let (status, text) = train(dir, &args);
        assert_eq!(status, 0, "{job}: {text}");
        for said in [
            "held-out rows labelled undesirable are left out of the accuracy",
            "left_out=1 kept=2",
        ] {
            assert!(text.contains(said), "{job}: no {said:?} in\n{text}");
        }
    }
}

/// A GRPO run whose rewards never tell a group's completions apart learns nothing from them: it
/// says so (a random model never writes a ten-digit answer), and logs TRL's frac_reward_zero_std.
#[test]
fn grpo_without_a_reward_signal_says_so() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    std::fs::write(
        dir.join("sums.jsonl"),
        "{\"prompt\": \"1+1=\", \"answer\": 2222222222}\n{\"prompt\": \"2+2=\", \"answer\": 4444444444}\n",
    )
    .unwrap();
    let out = dir.join("out");
    let args = format!(
        "grpo --no-progress --max-steps 2 --batch-size 2 --group-size 4 --reward exact:answer \
         --data {} --output-dir {}",
        dir.join("sums.jsonl").display(),
        out.display()
    );
    let args: Vec<String> = args.split(' ').map(String::from).collect();
    let (status, text) = train(dir, &args);
    assert_eq!(status, 0, "{text}");
    assert!(
        text.contains("every group's completions got the same reward in every batch of rollouts"),
        "{text}"
    );
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"frac_reward_zero_std\":1"), "{metrics}");
}
