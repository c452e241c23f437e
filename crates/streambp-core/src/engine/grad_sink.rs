//! Where parameter gradients go as the backward produces them: one accumulator per parameter,
//! found by role (head, final norm, embedding, layer `i`), in f32 for half-precision parameters.

use std::collections::{HashMap, HashSet};

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use streambp_kernels::ops::accumulate;
use streambp_kernels::ops::matmul;
use streambp_models::Model;

use crate::error::{EngineError, Result};

/// The dtype gradients of `dtype` parameters are summed in: f32 for half precision (a sum over many
/// chunks in bf16 would lose the small shares), the parameter's own otherwise.
fn accumulator_dtype(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        other => other,
    }
}

/// Accumulates parameter gradients across chunks and phases, detached (so no chunk's graph stays
/// alive) and in f32 for half-precision models (so chunking does not add rounding).
pub(super) struct GradSink {
    acc: HashMap<String, Tensor>,
    /// Accumulators made by the sink's own arithmetic, whose storage nothing else holds: these are
    /// added into in place ([`streambp_kernels::ops::accumulate`]).
    owned: HashSet<String>,
    /// Parameters whose finished gradients were handed on ([`super::FinishedGradients`]).
    taken: HashSet<String>,
}

impl GradSink {
    pub(super) fn new() -> Self {
        Self {
            acc: HashMap::new(),
            owned: HashSet::new(),
            taken: HashSet::new(),
        }
    }

    /// Removes and returns the accumulator of `name`.
    fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.owned.remove(name);
        self.acc.remove(name)
    }

    /// Hands over the (sealed) gradients of `params`, in their order; a parameter that got none is an
    /// error, as in [`GradSink::finish`].
    pub(super) fn take(&mut self, params: &[(String, Var)]) -> Result<Vec<(String, Tensor)>> {
        params
            .iter()
            .map(|(name, var)| {
                let g = self
                    .remove(name)
                    .ok_or_else(|| EngineError::MissingGradient(name.clone()))?;
                self.taken.insert(name.clone());
                Ok((name.clone(), g.to_dtype(var.dtype())?))
            })
            .collect()
    }

    /// Adds the gradients `store` holds for `params`.
    pub(super) fn absorb<'a>(
        &mut self,
        store: &GradStore,
        params: impl Iterator<Item = &'a (String, Var)>,
    ) -> Result<()> {
        for (name, var) in params {
            if let Some(g) = store.get(var.as_tensor()) {
                self.add(name, g.detach())?;
            }
        }
        Ok(())
    }

    /// The accumulator of `name` (`like`'s shape), made zero if there is none yet, for adding into in
    /// place; `None` where it could not be (one the sink does not own, or in another dtype). A half
    /// precision parameter's accumulator is f32 ([`accumulator_dtype`]).
    pub(super) fn accumulator(&mut self, name: &str, like: &Tensor) -> Result<Option<Tensor>> {
        self.accumulator_for(name, like.shape(), like.dtype(), like.device())
    }

    /// [`GradSink::accumulator`] for a parameter of this shape, dtype and device.
    fn accumulator_for(
        &mut self,
        name: &str,
        shape: &candle_core::Shape,
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<Option<Tensor>> {
        let dtype = accumulator_dtype(dtype);
        if !self.acc.contains_key(name) {
            let zeros = Tensor::zeros(shape, dtype, device)?;
            self.acc.insert(name.to_string(), zeros);
            self.owned.insert(name.to_string());
        }
        Ok(self
            .acc
            .get(name)
            .filter(|acc| self.owned.contains(name) && acc.dtype() == dtype)
            .cloned())
    }

    /// Adds a gradient that other tensors may share storage with (autograd's).
    fn add(&mut self, name: &str, grad: Tensor) -> Result<()> {
        self.accumulate(name, grad, false)
    }

    /// Adds the gradient `a·b` (a weight's share from one chunk: the LM head's `dzᵀ·h`), into the
    /// accumulator in place where it can. In half precision, where the product adds in place, the
    /// first chunk's share goes into a zero f32 accumulator too, never through a product rounded to
    /// bf16.
    pub(super) fn add_product(&mut self, name: &str, a: &Tensor, b: &Tensor) -> Result<()> {
        let half = accumulator_dtype(a.dtype()) != a.dtype();
        if !self.acc.contains_key(name) && half && accumulate::adds_products_in_place(a) {
            let shape = (a.dim(0)?, b.dim(1)?).into();
            self.accumulator_for(name, &shape, a.dtype(), a.device())?;
        }
        if let Some(acc) = self.acc.get(name) {
            if self.owned.contains(name) && accumulate::add_product(acc, a, b)? {
                return Ok(());
            }
        }
        self.accumulate(name, matmul::matmul(a, b)?, true)
    }

    /// [`GradSink::add_product`] for `a` f32 holding bf16 values and `b` bf16 (the LM head's
    /// `dzᵀ·h` on the host: [`accumulate::add_product_of_bf16_values`]), into the f32 accumulator.
    pub(super) fn add_product_of_bf16_values(
        &mut self,
        name: &str,
        a: &Tensor,
        b: &Tensor,
    ) -> Result<()> {
        let shape = (a.dim(0)?, b.dim(1)?).into();
        if let Some(acc) = self.accumulator_for(name, &shape, b.dtype(), b.device())? {
            if accumulate::add_product_of_bf16_values(&acc, a, b)? {
                return Ok(());
            }
        }
        self.accumulate(name, matmul::matmul_of_bf16_values(a, b)?, true)
    }

    /// Adds `rows[i]` into row `ids[i]` of the gradient of `name` (shaped like `table`): in place
    /// where [`accumulate::add_rows`] can (a half-precision table's rows widened into its f32 accumulator:
    /// `[rows, d]`, not the table), else as a table-sized sum added like any other.
    pub(super) fn add_rows(
        &mut self,
        name: &str,
        table: &Tensor,
        ids: &Tensor,
        rows: &Tensor,
    ) -> Result<()> {
        if rows.dtype() == table.dtype() && accumulate::adds_rows_in_place(table, rows)? {
            if let Some(acc) = self.accumulator(name, table)? {
                if accumulate::add_rows(&acc, ids, rows)? {
                    return Ok(());
                }
            }
        }
        let grad = table.detach().zeros_like()?.index_add(ids, rows, 0)?;
        self.accumulate(name, grad, true)
    }

    /// Adds `grad` (`fresh`: a tensor only the sink holds) to the accumulator of `name`: in place
    /// once the sink owns the accumulator (a half-precision gradient widened on the way), else as
    /// a new sum, which it then owns.
    fn accumulate(&mut self, name: &str, grad: Tensor, fresh: bool) -> Result<()> {
        if let Some(acc) = self.acc.get(name) {
            if self.owned.contains(name) && accumulate::add(acc, &grad)? {
                return Ok(());
            }
        }
        let dtype = accumulator_dtype(grad.dtype());
        let (grad, fresh) = match grad.dtype() == dtype {
            true => (grad, fresh),
            false => (grad.to_dtype(dtype)?, true),
        };
        let (sum, owned) = match self.remove(name) {
            Some(prev) => ((prev.to_dtype(grad.dtype())? + grad)?, true),
            None => (grad, fresh),
        };
        if owned {
            self.owned.insert(name.to_string());
        }
        self.acc.insert(name.to_string(), sum);
        Ok(())
    }

    /// Rounds the gradients of `params` to their parameters' dtype once nothing more will be added to
    /// them (a layer after its backward): the result is the same as rounding at the end, and a bf16
    /// model then holds 2 bytes per finished gradient instead of 4.
    pub(super) fn seal<'a>(
        &mut self,
        params: impl Iterator<Item = &'a (String, Var)>,
    ) -> Result<()> {
        for (name, var) in params {
            if let Some(g) = self.acc.get_mut(name) {
                if g.dtype() != var.dtype() {
                    *g = g.to_dtype(var.dtype())?;
                }
            }
        }
        Ok(())
    }

    /// Every parameter's gradient in the model's order and dtype; a parameter that received none is an
    /// error (a dropped gradient must never read as zero).
    pub(super) fn finish(mut self, model: &Model) -> Result<Vec<(String, Tensor)>> {
        model
            .parameters()
            .iter()
            .filter(|(name, _)| !self.taken.contains(name))
            .map(|(name, var)| {
                let g = self
                    .acc
                    .remove(name)
                    .ok_or_else(|| EngineError::MissingGradient(name.clone()))?;
                Ok((name.clone(), g.to_dtype(var.dtype())?))
            })
            .collect()
    }
}
