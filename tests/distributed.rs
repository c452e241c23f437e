//! Data- and sequence-parallel training under `mpiexec`: two ranks train exactly as one process does
//! on the same global batches, or on the same batches each holding half of every sequence (SFT, DPO
//! with an NLL term, GRPO; ZeRO 0, 1 and 2; gradient accumulation; the built-in rows differ in
//! length, so the ranks' token counts differ), each rank's optimizer shard
//! holds half of the moments, and a job that loses a rank (data or sequence parallel) fails naming
//! it, leaves no half-written checkpoint, resumes to the uninterrupted run's numbers and refuses
//! another number of ranks.
//!
//! Needs the `mpi` feature and MPICH's `mpiexec` on the PATH; without them the tests say so and pass,
//! unless `STREAMBP_REQUIRE_MPI=1` (CI) makes that a failure.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use candle_core::{DType, Device};

fn mpi_available() -> bool {
    streambp_testkit::mpi_available(cfg!(feature = "mpi"))
}

/// `streambp-train <args> --output-dir out`, on `ranks` processes (`mpiexec -n ranks`) or plainly.
fn command(ranks: usize, out: &Path, args: &str) -> Command {
    let exe = env!("CARGO_BIN_EXE_streambp-train");
    let mut cmd = match ranks {
        1 => streambp_testkit::command(exe),
        n => {
            let mut c = Command::new("mpiexec");
            c.args(["-n", &n.to_string(), exe]);
            c
        }
    };
    cmd.args(args.split_whitespace())
        .args(["--no-progress", "--dtype", "f64", "--output-dir"])
        .arg(out)
        .env("RUST_LOG", "warn");
    cmd
}

fn run(ranks: usize, out: &Path, args: &str) -> Output {
    let output = command(ranks, out, args).output().unwrap();
    assert!(
        output.status.success(),
        "{ranks} rank(s) of `{args}` failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Each training step's `key` (metrics.jsonl, written by rank 0; eval rows, which have no loss,
/// left out).
fn logged(out: &Path, key: &str) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|row| row.get("loss").is_some())
        .filter_map(|row| row[key].as_f64())
        .collect()
}

fn tensors(file: &Path) -> HashMap<String, Vec<f64>> {
    candle_core::safetensors::load(file, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let v = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
            (k, v.to_vec1::<f64>().unwrap())
        })
        .collect()
}

/// The largest difference between two runs' per-step `key`s.
fn max_logged_diff(a: &Path, b: &Path, key: &str) -> f64 {
    let (x, y) = (logged(a, key), logged(b, key));
    assert_eq!(x.len(), y.len(), "{key}: steps logged");
    x.iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs())
        .fold(0.0, f64::max)
}

/// The largest difference between two safetensors files' values, key by key.
fn max_weight_diff(a: &Path, b: &Path) -> f64 {
    let (x, y) = (tensors(a), tensors(b));
    assert_eq!(x.len(), y.len(), "{} and {}", a.display(), b.display());
    x.iter()
        .map(|(k, v)| {
            let w = &y[k];
            assert_eq!(v.len(), w.len(), "{k}");
            v.iter()
                .zip(w)
                .map(|(p, q)| (p - q).abs())
                .fold(0.0, f64::max)
        })
        .fold(0.0, f64::max)
}

/// What a run trained: its final model, or its adapter under LoRA.
fn final_weights(out: &Path) -> PathBuf {
    let adapter = out.join("final/adapter_model.safetensors");
    match adapter.exists() {
        true => adapter,
        false => out.join("final/model.safetensors"),
    }
}

/// Runs `one` on one process and `many(zero)` on `ranks` ranks at each ZeRO stage, and checks that
/// the losses, gradient norms and final weights agree.
fn assert_same_as_one_process(
    one_args: &str,
    (ranks, many_args): (usize, impl Fn(usize) -> String),
) {
    let one = tempfile::tempdir().unwrap();
    run(1, one.path(), one_args);
    for zero in [0, 1, 2] {
        let two = tempfile::tempdir().unwrap();
        let args = many_args(zero);
        run(ranks, two.path(), &args);
        for key in ["loss", "grad_norm"] {
            let diff = max_logged_diff(one.path(), two.path(), key);
            eprintln!("`{args}`: {key} differs by {diff:e}");
            assert!(diff < 1e-12, "`{args}`: {key} differs by {diff:e}");
        }
        let diff = max_weight_diff(&final_weights(one.path()), &final_weights(two.path()));
        eprintln!("`{args}`: final weights differ by {diff:e}");
        assert!(diff < 1e-12, "`{args}`: final weights differ by {diff:e}");
    }
}

/// Runs `args` on one process with `--batch-size 2b` and on two ranks with `--batch-size b` (the same
/// global batches) and checks the losses, gradient norms and final weights agree.
fn assert_two_ranks_match_one(args_with_batch: impl Fn(usize) -> String, b: usize) {
    let two = |zero| format!("{} --zero {zero}", args_with_batch(b));
    assert_same_as_one_process(&args_with_batch(2 * b), (2, two));
}

/// Sequence parallelism: two ranks splitting every sequence (`--sp 2`, each holding half of every
/// row's positions, the same batches on both) train as one process does: SFT with accumulation,
/// DPO with its NLL term (a loss of whole sequences), GRPO with a KL term and two iterations (its
/// reference and old policy scored on the split sequences too; three prompts a micro-batch, sampled
/// two on one rank and one on the other and shared; with vespo's, the sequence level's and the
/// off-policy mask's terms of whole rows; RLOO's ratio of whole rows; the entropies of the split
/// rows' positions, their bonus and their high-entropy mask; distillation, the teacher's forward
/// split as the student's and its logits read at each rank's positions), a LoRA adapter with dropout (its masks drawn
/// by position in the whole row), and packed rows of 23 tokens (spans of 12 and 11, documents
/// crossing between them).
#[test]
fn sequences_split_over_two_ranks_train_as_one_process() {
    if !mpi_available() {
        return;
    }
    for args in [
        "sft --max-steps 3 --batch-size 4 --grad-accum 2 --chunk 3 --seed 4",
        "dpo --max-steps 2 --batch-size 2 --grad-accum 2 --sft-weight 0.5 --chunk 2 --seed 2",
        "grpo --max-steps 2 --batch-size 3 --group-size 4 --num-iterations 2 --beta 0.04 --seed 7",
        "grpo --max-steps 2 --batch-size 3 --group-size 4 --num-iterations 2 --beta 0.04 --seed 7 \
         --loss-type vespo --importance-sampling-level sequence --off-policy-mask-threshold 0.01",
        "rloo --max-steps 2 --batch-size 3 --group-size 4 --num-iterations 2 --beta 0.04 --seed 7 \
         --normalize-advantages",
        "grpo --max-steps 2 --batch-size 3 --group-size 4 --num-iterations 2 --seed 7 \
         --entropy-coef 0.1 --top-entropy-quantile 0.5",
        "distill --max-steps 2 --batch-size 3 --beta 0.5 --seed 7",
        "sft --max-steps 2 --batch-size 2 --chunk 2 --lora-r 4 --lora-dropout 0.3 --lr 1e-2 --seed 3",
        "sft --max-steps 2 --batch-size 2 --packing --max-length 23 --chunk 4 --seed 6",
    ] {
        assert_same_as_one_process(args, (2, |zero| format!("{args} --sp 2 --zero {zero}")));
    }
}

/// Data 2 x sequence 2 on four ranks: ranks {0, 1} and {2, 3} each split the sequences of their
/// half of every global batch, and train as one process on the whole batches (GRPO's high-entropy
/// quantile too, over both data groups' tokens).
#[test]
fn data_groups_of_sequence_groups_train_as_one_process() {
    if !mpi_available() {
        return;
    }
    for job in [
        "sft --max-steps 2 --grad-accum 2 --chunk 3 --seed 4",
        "dpo --max-steps 2 --sft-weight 0.5 --chunk 2 --seed 2",
        "grpo --max-steps 2 --group-size 4 --num-iterations 2 --beta 0.04 --seed 7",
        "grpo --max-steps 2 --group-size 4 --seed 7 --top-entropy-quantile 0.4",
    ] {
        let four = |zero| format!("{job} --batch-size 1 --sp 2 --zero {zero}");
        assert_same_as_one_process(&format!("{job} --batch-size 2"), (4, four));
    }
}

#[test]
fn sft_on_two_ranks_is_one_process() {
    if !mpi_available() {
        return;
    }
    assert_two_ranks_match_one(
        |b| format!("sft --max-steps 4 --batch-size {b} --grad-accum 2 --chunk 3 --seed 4"),
        4,
    );
}

#[test]
fn dpo_with_nll_on_two_ranks_is_one_process() {
    if !mpi_available() {
        return;
    }
    assert_two_ranks_match_one(
        |b| {
            format!(
                "dpo --max-steps 3 --batch-size {b} --grad-accum 2 --sft-weight 0.5 --chunk 5 --seed 2"
            )
        },
        2,
    );
}

/// ORPO (its NLL over every chosen token, one mean over the micro-batch whichever rank holds the
/// tokens) and CPO's SimPO with the NLL term. (KTO is not here: its KL baseline comes from each
/// rank's own rows, as TRL's from each device's, so two ranks are not one process there.)
#[test]
fn orpo_and_cpo_on_two_ranks_are_one_process() {
    if !mpi_available() {
        return;
    }
    for job in ["orpo", "cpo --loss-type simpo --cpo-alpha 0.5"] {
        assert_two_ranks_match_one(
            |b| format!("{job} --max-steps 3 --batch-size {b} --grad-accum 2 --chunk 5 --seed 2"),
            2,
        );
    }
}

/// GRPO with TRL's default dapo (one normaliser over both ranks' tokens); with cispo and rewards
/// scaled by the whole batch's standard deviation (both summed over the ranks); with truncated
/// completions masked out of completions of at most 2 tokens (groups left without any run at
/// weight 0, so the ranks' calls stay paired); GSPO's weights under luspo (a mean over rows); and the
/// high-entropy mask, its quantile over both ranks' completion tokens (TRL gathers them across
/// processes), with truncated completions masked out too. (The entropy bonus is not here: as TRL's, it is a token mean per micro-batch, so two ranks'
/// halves are not one process's whole, as two GPUs are not one under TRL.)
#[test]
fn grpo_on_two_ranks_is_one_process() {
    if !mpi_available() {
        return;
    }
    for extra in [
        "",
        " --loss-type cispo --epsilon-high 4 --scale-rewards batch",
        " --mask-truncated-completions --max-new-tokens 2",
        " --loss-type luspo --importance-sampling-level sequence --epsilon 0.05",
        " --top-entropy-quantile 0.4 --mask-truncated-completions --max-new-tokens 3",
    ] {
        assert_two_ranks_match_one(
            |b| {
                format!(
                    "grpo --max-steps 4 --batch-size {b} --group-size 4 --num-iterations 2 \
                     --beta 0.04 --seed 7{extra}"
                )
            },
            1,
        );
    }
}

/// RLOO: its KL in the reward (the reference scored when the rollouts are drawn) and its
/// advantages normalised over both ranks' completions, as on one process.
#[test]
fn rloo_on_two_ranks_is_one_process() {
    if !mpi_available() {
        return;
    }
    assert_two_ranks_match_one(
        |b| {
            format!(
                "rloo --max-steps 4 --batch-size {b} --group-size 4 --num-iterations 2 \
                 --beta 0.04 --normalize-advantages --seed 7"
            )
        },
        1,
    );
}

/// Distillation: the divergences of both ranks' completions over their count (TRL's
/// num_items_in_batch across processes), as on one process; the teacher is the shipped SFT
/// checkpoint on every rank.
#[test]
fn distill_on_two_ranks_is_one_process() {
    if !mpi_available() {
        return;
    }
    assert_two_ranks_match_one(
        |b| format!("distill --max-steps 3 --batch-size {b} --beta 0.5 --seed 7"),
        2,
    );
}

/// Element counts of each tensor group in a checkpoint's optimizer file(s).
fn elements(files: &[PathBuf]) -> usize {
    files
        .iter()
        .flat_map(|f| tensors(f).into_values())
        .map(|v| v.len())
        .sum()
}

#[test]
fn zero_shards_hold_half_of_the_moments_each() {
    if !mpi_available() {
        return;
    }
    let args = "sft --max-steps 3 --save-every 2 --batch-size 4 --seed 1";
    let whole = tempfile::tempdir().unwrap();
    run(1, whole.path(), args);
    let whole_elements = elements(&[whole.path().join("checkpoint-2/optimizer.safetensors")]);
    for zero in [1, 2] {
        let sharded = tempfile::tempdir().unwrap();
        run(2, sharded.path(), &format!("{args} --zero {zero}"));
        let dir = sharded.path().join("checkpoint-2");
        assert!(!dir.join("optimizer.safetensors").exists());
        let shards: Vec<PathBuf> = (0..2)
            .map(|r| dir.join(format!("optimizer-rank-{r}-of-2.safetensors")))
            .collect();
        let per_rank: Vec<usize> = shards
            .iter()
            .map(|f| elements(std::slice::from_ref(f)))
            .collect();
        assert_eq!(per_rank[0], per_rank[1], "zero {zero}: equal shards");
        // Each bucket pads to an even length: at most one element per bucket and moment.
        let padding = elements(&shards) - whole_elements;
        assert!(
            padding <= 2 * 2 * 16,
            "zero {zero}: the shards hold {} elements for {whole_elements}",
            elements(&shards)
        );
    }
}

/// The pids of the processes running `exe` whose environment says they are MPI rank `rank` and
/// whose command line names `out`.
fn rank_pid(out: &Path, rank: usize) -> Option<u32> {
    let needle = out.to_string_lossy().into_owned();
    std::fs::read_dir("/proc").ok()?.find_map(|entry| {
        let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !cmdline.starts_with(env!("CARGO_BIN_EXE_streambp-train")) || !cmdline.contains(&needle)
        {
            return None;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let is_rank = environ
            .split(|b| *b == 0)
            .any(|kv| kv == format!("PMI_RANK={rank}").as_bytes());
        is_rank.then_some(pid)
    })
}

/// Hidden directories of interrupted saves.
fn debris(out: &Path) -> Vec<String> {
    std::fs::read_dir(out)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('.') && (n.contains(".tmp-") || n.contains(".old-")))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn losing_a_rank_fails_the_job_and_it_resumes_exactly() {
    if !mpi_available() {
        return;
    }
    let args = "sft --max-steps 40 --save-every 4 --batch-size 4 --zero 2 --seed 9";
    kill_and_resume(args);
    // The same with each sequence split over the two ranks.
    kill_and_resume(&format!("{args} --sp 2"));
}

/// Kills rank 1 of `args` on two ranks once its second checkpoint is written, checks the failure is
/// reported by name and leaves no half-written checkpoint, reruns to the uninterrupted run's losses
/// and weights, and has its checkpoint refused by one process.
fn kill_and_resume(args: &str) {
    let whole = tempfile::tempdir().unwrap();
    run(2, whole.path(), args);

    let out = tempfile::tempdir().unwrap();
    let mut job = command(2, out.path(), args)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let mut killed = None;
    while job.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(120) {
        if out.path().join("checkpoint-8").exists() {
            if let (Some(pid), Some(survivor)) = (rank_pid(out.path(), 1), rank_pid(out.path(), 0))
            {
                Command::new("kill")
                    .args(["-9", &pid.to_string()])
                    .status()
                    .unwrap();
                killed = Some((pid, survivor));
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let failed = job.wait_with_output().unwrap();
    let (pid, survivor) = killed.expect("the job ended before rank 1 could be killed");
    assert!(!failed.status.success(), "a job that lost a rank succeeded");
    // The launcher names the first process to end badly (MPICH's hydra: its pid and signal), and
    // the job's log which rank each pid was. That is usually the killed one; under load the
    // survivor can go first, aborted by its transport's failed read from the dead peer (UCX:
    // `process_vm_readv ... No such process`), and then hydra names it instead.
    let report = [&failed.stdout, &failed.stderr].map(|s| String::from_utf8_lossy(s).into_owned());
    let report = report.join("\n");
    assert!(report.contains(&format!("rank 1: pid {pid}")), "{report}");
    assert!(
        report.contains(&format!("rank 0: pid {survivor}")),
        "{report}"
    );
    let named = |p: u32| report.contains(&format!("PID {p} "));
    assert!(named(pid) || named(survivor), "{report}");
    assert!(!out.path().join("final").exists());

    // The next run (replacing the killed one's checkpoints) cleans up whatever save was interrupted
    // and reproduces the uninterrupted losses.
    run(2, out.path(), &format!("{args} --overwrite-output-dir"));
    assert!(debris(out.path()).is_empty(), "{:?}", debris(out.path()));
    let steps = logged(out.path(), "step");
    let expected: Vec<f64> = (1..=40).map(|s| s as f64).collect();
    assert_eq!(steps, expected, "each step logged once");
    let diff = max_logged_diff(whole.path(), out.path(), "loss");
    assert_eq!(diff, 0.0, "resumed losses differ by {diff:e}");
    let diff = max_weight_diff(
        &whole.path().join("final/model.safetensors"),
        &out.path().join("final/model.safetensors"),
    );
    assert_eq!(diff, 0.0, "resumed weights differ by {diff:e}");

    // Its sharded optimizer state resumes on two ranks only.
    let alone = args.replace(" --sp 2", "");
    let report = refused_resume(1, &alone, &out.path().join("checkpoint-36"));
    assert!(
        report.contains("ranks: 2 in the checkpoint's run, 1 now"),
        "{report}"
    );
}

/// The error output of `args` on `ranks` resuming `checkpoint`, which must fail.
fn refused_resume(ranks: usize, args: &str, checkpoint: &Path) -> String {
    let other = tempfile::tempdir().unwrap();
    let refused = command(ranks, other.path(), args)
        .arg("--resume")
        .arg(checkpoint)
        .output()
        .unwrap();
    assert!(!refused.status.success(), "`{args}` resumed");
    String::from_utf8_lossy(&refused.stderr).into_owned()
}

/// A `--sp 2` run resumed from its checkpoint goes on to the uninterrupted run's losses and weights,
/// bit for bit; a resume with another `--sp` on the same ranks is refused by name.
#[test]
fn a_sequence_parallel_run_resumes_exactly() {
    if !mpi_available() {
        return;
    }
    let args = "sft --max-steps 6 --save-every 3 --batch-size 2 --chunk 3 --seed 5";
    let whole = tempfile::tempdir().unwrap();
    run(2, whole.path(), &format!("{args} --sp 2 --zero 2"));
    let checkpoint = whole.path().join("checkpoint-3");

    let resumed = tempfile::tempdir().unwrap();
    let resume = format!("{args} --sp 2 --zero 2 --resume {}", checkpoint.display());
    run(2, resumed.path(), &resume);
    let (before, after) = (logged(whole.path(), "loss"), logged(resumed.path(), "loss"));
    assert_eq!(after, before[3..], "steps 4-6 resumed");
    let diff = max_weight_diff(
        &whole.path().join("final/model.safetensors"),
        &resumed.path().join("final/model.safetensors"),
    );
    assert_eq!(diff, 0.0, "resumed weights differ by {diff:e}");

    let report = refused_resume(2, &format!("{args} --sp 1 --zero 2"), &checkpoint);
    assert!(
        report.contains("--sp: 2 in the checkpoint's run, 1 now"),
        "{report}"
    );
}
