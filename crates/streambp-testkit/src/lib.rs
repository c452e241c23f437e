//! Helpers shared by the streambp crates' tests: the committed fixtures under `tests/fixtures` (written
//! by `scripts/make_fixtures.py`) and the error measures the tests assert on. Test code: it panics on
//! anything unexpected.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, Var};

/// The fixture families, one tiny random model each.
pub const FAMILIES: [&str; 4] = ["qwen2", "qwen3", "llama3", "gemma3"];

/// `tests/fixtures/<name>`; `STREAMBP_FIXTURES` overrides the folder (a test binary carried to another
/// machine, e.g. the GPU one, where the build's source path does not exist).
pub fn fixture_dir(name: &str) -> PathBuf {
    std::env::var_os("STREAMBP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"))
        .join(name)
}

/// The fixture's float64 references (batch, logits, losses, gradients).
pub fn reference(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        fixture_dir(name).join("reference.safetensors"),
        &Device::Cpu,
    )
    .expect("fixture reference.safetensors")
}

/// The fixture's `meta.json` (what the script recorded about it).
pub fn meta(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture_dir(name).join("meta.json")).expect("meta.json");
    serde_json::from_str(&text).expect("meta.json is JSON")
}

fn max_of(t: Tensor) -> f64 {
    t.flatten_all()
        .and_then(|t| t.max(0))
        .and_then(|t| t.to_scalar::<f64>())
        .expect("max of a tensor")
}

/// Max relative error of two tensors of any shape: `max |a - b| / max |b|`.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let diff = (a - &b).unwrap().abs().unwrap();
    max_of(diff) / max_of(b.abs().unwrap()).max(f64::MIN_POSITIVE)
}

/// The largest absolute element-wise difference of `a` and `b` (any float dtype), as f64.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    max_of(
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap(),
    )
}

/// The gradients of `Σ y ⊙ g` with respect to each of `wrt`, in order.
pub fn grads(y: &Tensor, g: &Tensor, wrt: &[&Var]) -> Vec<Tensor> {
    let store = (y * g).unwrap().sum_all().unwrap().backward().unwrap();
    wrt.iter()
        .map(|v| store.get(v.as_tensor()).unwrap().clone())
        .collect()
}

/// [`rel_err`] over the positions where `mask` (`[b, t]`) is 1; `a`, `b` are `[b, t, v]`.
pub fn masked_rel_err(a: &Tensor, b: &Tensor, mask: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let m = mask.to_dtype(DType::F64).unwrap().unsqueeze(2).unwrap();
    let diff = (a - &b).unwrap().abs().unwrap().broadcast_mul(&m).unwrap();
    let scale = b.abs().unwrap().broadcast_mul(&m).unwrap();
    max_of(diff) / max_of(scale).max(f64::MIN_POSITIVE)
}

/// A command running `program` as the test itself runs: under cargo's runner for this target where
/// one is set (`CARGO_TARGET_<TRIPLE>_RUNNER`, split on whitespace as cargo does), so that a test run
/// under an emulator (`qemu-x86_64 -cpu EPYC-Milan`: a CPU without AVX-512) starts its children,
/// the CLI or the test binary again, on the same emulated CPU rather than on the host's.
pub fn command(program: impl AsRef<std::ffi::OsStr>) -> std::process::Command {
    let this_target = |name: &str| {
        name.starts_with("CARGO_TARGET_")
            && name.ends_with("_RUNNER")
            && name.contains(&std::env::consts::ARCH.to_uppercase())
            && name.contains(&std::env::consts::OS.to_uppercase())
    };
    let runner = std::env::vars().find(|(name, _)| this_target(name));
    let mut words = runner
        .iter()
        .flat_map(|(_, value)| value.split_whitespace());
    match words.next() {
        Some(emulator) => {
            let mut command = std::process::Command::new(emulator);
            command.args(words).arg(program);
            command
        }
        None => std::process::Command::new(program),
    }
}

/// Whether a test that launches ranks with `mpiexec` can run: the test binary was built with the `mpi`
/// feature (`built_with_mpi`: the caller's `cfg!(feature = "mpi")`) and `mpiexec` is on the PATH.
/// Otherwise it says why and returns false (the test passes without running), unless
/// `STREAMBP_REQUIRE_MPI=1` (CI), where it panics: there the tests must not skip.
pub fn mpi_available(built_with_mpi: bool) -> bool {
    let launcher = std::process::Command::new("mpiexec")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let why = match (built_with_mpi, launcher) {
        (true, true) => return true,
        (false, _) => "built without the `mpi` feature",
        (true, false) => "no `mpiexec` on the PATH",
    };
    if std::env::var("STREAMBP_REQUIRE_MPI").is_ok_and(|v| v == "1") {
        panic!("STREAMBP_REQUIRE_MPI=1 but the distributed tests cannot run: {why}");
    }
    eprintln!("skipped: {why} (cargo test --features mpi, with MPICH installed)");
    false
}

/// One run's loss and gradients (`got`) against the full backward's gradients (`full`, each within
/// 1e-10) and a float64 reference's (`reference`'s `{prefix}.loss` within 1e-10, `{prefix}.grad.{name}`
/// within 1e-8); `what` names the run in failures. Returns the worst gradient error against the
/// reference.
pub fn assert_exact(
    what: &str,
    (loss, grads): (f64, &[(String, Tensor)]),
    full: &[(String, Tensor)],
    (reference, prefix): (&HashMap<String, Tensor>, &str),
) -> f64 {
    let ref_loss = reference[&format!("{prefix}.loss")]
        .to_vec1::<f64>()
        .unwrap()[0];
    assert!(
        (loss - ref_loss).abs() < 1e-10 * ref_loss.abs().max(1e-3),
        "{what}: loss {loss} vs reference {ref_loss}"
    );
    let mut worst = 0.0f64;
    for ((name, g), (_, g_full)) in grads.iter().zip(full) {
        let vs_full = rel_err(g, g_full);
        assert!(vs_full < 1e-10, "{what}: {name} vs full {vs_full:.2e}");
        let vs_ref = rel_err(g, &reference[&format!("{prefix}.grad.{name}")]);
        worst = worst.max(vs_ref);
        assert!(vs_ref < 1e-8, "{what}: {name} vs reference {vs_ref:.2e}");
    }
    worst
}
