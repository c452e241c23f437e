//! The generalized Jensen-Shannon divergence between the softmaxes of two logits chunks, per row
//! (TRL's `generalized_jsd_loss`, distillation's): `β = 0` the forward KL `KL(p_t‖p_s)`, `β = 1` the
//! reverse KL `KL(p_s‖p_t)`, between `β·KL(p_t‖m) + (1 − β)·KL(p_s‖m)` with
//! `m = (1 − β)·p_s + β·p_t`; differentiable in the student's logits (the teacher's are constants).
//!
//! [`generalized_jsd`] picks the implementation by [`Backend`]: on the CPU (f32, f64) the forward is
//! one op that makes each row's two softmaxes in a row of scratch and sums the divergence, and the
//! backward one op that writes the gradient out (`β = 0`: `p_s − p_t`; `β = 1`:
//! `p_s·(log p_s − log p_t − KL)`; between: `(1 − β)·p_s·(log p_s − log m − KL(p_s‖m))`), so a
//! chunk holds its two logits and one gradient where the composed ops' autograd holds about ten
//! `[rows, vocab]` tensors. [`composed`] is the reference and every other device's path.

mod cpu;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};

use crate::backend::Backend;
use crate::host::storage::input_data;

type CResult<T> = candle_core::Result<T>;

/// Each row's divergence (`[..]`: the logits' leading dims) between `softmax(student)` and
/// `softmax(teacher)` (`[.., vocab]` each, one dtype and shape), `beta` in `[0, 1]`.
pub fn generalized_jsd(student: &Tensor, teacher: &Tensor, beta: f64) -> CResult<Tensor> {
    if !(0.0..=1.0).contains(&beta) {
        candle_core::bail!("generalized JSD: beta {beta} outside [0, 1]");
    }
    let alike = student.dtype() == teacher.dtype() && student.shape() == teacher.shape();
    let host_float = matches!(student.dtype(), DType::F32 | DType::F64);
    match Backend::of(student) {
        Backend::Cpu if alike && host_float && student.rank() >= 1 => {
            let dims = student.dims();
            let vocab = dims[dims.len() - 1];
            let rows = dims[..dims.len() - 1].to_vec();
            let flat = |t: &Tensor| t.reshape(((), vocab.max(1)))?.contiguous();
            let op = Forward(cpu::Jsd { beta });
            let per_row = flat(student)?.apply_op2(&flat(&teacher.detach())?, op)?;
            per_row.reshape(rows)
        }
        _ => composed(student, teacher, beta),
    }
}

/// [`generalized_jsd`] from tensor ops (every device and dtype; autograd differentiates it).
pub fn composed(student: &Tensor, teacher: &Tensor, beta: f64) -> CResult<Tensor> {
    let log_softmax =
        |z: &Tensor| z.broadcast_sub(&z.log_sum_exp(D::Minus1)?.unsqueeze(D::Minus1)?);
    let (log_ps, log_pt) = (log_softmax(student)?, log_softmax(teacher)?);
    // KL(p ‖ q) at each row from log p and log q.
    let kl = |log_p: &Tensor, log_q: &Tensor| (log_p.exp()? * (log_p - log_q)?)?.sum(D::Minus1);
    if beta == 0.0 {
        return kl(&log_pt, &log_ps);
    }
    if beta == 1.0 {
        return kl(&log_ps, &log_pt);
    }
    // log m = logaddexp(log p_s + ln(1 − β), log p_t + ln β).
    let (a, b) = ((&log_ps + (1.0 - beta).ln())?, (&log_pt + beta.ln())?);
    let top = a.maximum(&b)?.detach();
    let log_m = (((&a - &top)?.exp()? + (&b - &top)?.exp()?)?.log()? + &top)?;
    (kl(&log_pt, &log_m)? * beta)? + (kl(&log_ps, &log_m)? * (1.0 - beta))?
}

/// The forward: `[rows]` divergences of `[rows, vocab]` student and teacher logits.
struct Forward(cpu::Jsd);

impl CustomOp2 for Forward {
    fn name(&self) -> &'static str {
        "streambp-generalized-jsd"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        sl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (rows, vocab) = sl.shape().dims2()?;
        let out = match (ss, ts) {
            (CpuStorage::F32(_), CpuStorage::F32(_)) => CpuStorage::F32(self.0.forward::<f32>(
                input_data(ss, sl)?,
                input_data(ts, tl)?,
                vocab,
            )),
            (CpuStorage::F64(_), CpuStorage::F64(_)) => CpuStorage::F64(self.0.forward::<f64>(
                input_data(ss, sl)?,
                input_data(ts, tl)?,
                vocab,
            )),
            _ => candle_core::bail!("generalized JSD: logits not both f32 or f64"),
        };
        Ok((out, Shape::from(rows)))
    }

    /// [`Backward`] of the student's logits; none for the teacher's.
    fn bwd(
        &self,
        student: &Tensor,
        teacher: &Tensor,
        _out: &Tensor,
        g: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let g = g.contiguous()?;
        let dz = student
            .detach()
            .apply_op3_no_bwd(&teacher.detach(), &g, &Backward(self.0))?;
        Ok((Some(dz), None))
    }
}

/// The student's logits' gradient for the rows' gradients `g` (`[rows]`).
struct Backward(cpu::Jsd);

impl CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "streambp-generalized-jsd-backward"
    }

    fn cpu_fwd(
        &self,
        ss: &CpuStorage,
        sl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let vocab = sl.shape().dims2()?.1;
        let out = match (ss, ts, gs) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
                CpuStorage::F32(self.0.backward::<f32>(
                    input_data(ss, sl)?,
                    input_data(ts, tl)?,
                    input_data(gs, gl)?,
                    vocab,
                ))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => {
                CpuStorage::F64(self.0.backward::<f64>(
                    input_data(ss, sl)?,
                    input_data(ts, tl)?,
                    input_data(gs, gl)?,
                    vocab,
                ))
            }
            _ => candle_core::bail!("generalized JSD backward: inputs not all f32 or f64"),
        };
        Ok((out, sl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use streambp_testkit::{grads, max_diff};

    /// The largest difference, relative to the largest reference value where that passes 1.
    fn err(a: &Tensor, b: &Tensor) -> f64 {
        let top = b
            .abs()
            .and_then(|t| t.to_dtype(DType::F64))
            .and_then(|t| t.max_all());
        max_diff(a, b) / top.and_then(|t| t.to_scalar::<f64>()).unwrap().max(1.0)
    }

    /// The CPU ops and the composed ops: equal divergences and student gradients for both ends and
    /// between, in f64 to 1e-12 and in f32 to 1e-5 (of the largest value where it passes 1), on rows of equal logits, logits far apart, one
    /// row and one column, and `[b, c, V]` chunks; the teacher gets no gradient.
    #[test]
    fn the_cpu_divergence_matches_the_composed_one() {
        let dev = Device::Cpu;
        for (dtype, bound) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            for beta in [0.0, 0.1, 0.5, 0.9, 1.0] {
                for shape in [vec![1, 1], vec![3, 37], vec![2, 5, 300]] {
                    let randn = |std: f64| {
                        Tensor::randn(0f64, std, shape.as_slice(), &dev)
                            .and_then(|t| t.to_dtype(dtype))
                            .unwrap()
                    };
                    let mut s = randn(3.0);
                    let vocab = shape[shape.len() - 1];
                    if shape.len() == 3 {
                        // A row of equal logits, and one with logits 120 apart.
                        let rows = s.reshape(((), vocab)).unwrap();
                        let mut v = rows.to_dtype(DType::F64).unwrap().to_vec2::<f64>().unwrap();
                        v[0].iter_mut().for_each(|x| *x = 1.5);
                        v[1][0] = 60.0;
                        v[1][1] = -60.0;
                        s = Tensor::new(v, &dev)
                            .and_then(|t| t.to_dtype(dtype))
                            .and_then(|t| t.reshape(shape.as_slice()))
                            .unwrap();
                    }
                    let student = Var::from_tensor(&s).unwrap();
                    let teacher = Var::from_tensor(&randn(2.0)).unwrap();
                    let what = format!("{dtype:?} beta {beta} {shape:?}");
                    let fused =
                        generalized_jsd(student.as_tensor(), teacher.as_tensor(), beta).unwrap();
                    let reference =
                        composed(student.as_tensor(), &teacher.as_tensor().detach(), beta).unwrap();
                    assert_eq!(fused.dims(), reference.dims(), "{what}");
                    let e = err(&fused, &reference);
                    assert!(e < bound, "{what}: {e:.1e}");
                    let g = Tensor::randn(0f64, 1.0, fused.shape(), &dev)
                        .and_then(|t| t.to_dtype(dtype))
                        .unwrap();
                    let f = grads(&fused, &g, &[&student]);
                    let c = grads(&reference, &g, &[&student]);
                    let e = err(&f[0], &c[0]);
                    assert!(e < bound, "d student {what}: {e:.1e}");
                    let store = (&fused * &g)
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    assert!(store.get(teacher.as_tensor()).is_none(), "{what}");
                }
            }
        }
    }

    #[test]
    fn a_beta_outside_the_unit_interval_is_refused() {
        let z = Tensor::zeros((2, 3), DType::F64, &Device::Cpu).unwrap();
        assert!(generalized_jsd(&z, &z, 1.5).is_err());
        assert!(generalized_jsd(&z, &z, -0.1).is_err());
    }
}
