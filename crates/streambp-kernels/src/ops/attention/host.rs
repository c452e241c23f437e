//! The CPU kernel's glue: whether it takes an op's inputs, their data read in place as the kernel
//! reads it (each head's rows contiguous, the earlier keys' storages locked meanwhile), its key
//! blocks with their masks, and its forward and backward on tensors or on the op's storages.

use candle_core::{CpuStorage, DType, Device, Layout, Shape, Tensor, WithDType};

use super::kernel::{self, KernelFloat, Multiply};
use super::op::{poisoned, Attention, HeadsLayout, Saved};
use super::{Blocks, EarlierKeys, KeyRange, Normalizer, Products, Stats, KERNEL_OFF};
use crate::backend::Backend;
use crate::host::half_product::Kernel;
use crate::host::storage::{host_float, host_slice, input_data, storage_id, with_data_mut};
use crate::op_times;

type CResult<T> = candle_core::Result<T>;

impl Blocks {
    /// How the kernel multiplies where it takes bf16 products ([`Products::Bf16`]): f32 queries
    /// and the kernel running (see [`Blocks::kernel_applies`]); `None` elsewhere.
    pub(super) fn bf16_products(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> CResult<Option<Multiply>> {
        let applies = self.products == Products::Bf16
            && q.dtype() == DType::F32
            && self.kernel_applies(q, k, v)?;
        Ok(applies.then(|| Multiply::Bf16 {
            kernel: Kernel::detect(),
            scale: self.scale as f32,
        }))
    }

    /// How the CPU kernel multiplies where it runs the forward of q (unscaled), k and v as they
    /// are ([`Blocks::kernel_applies`]); `None` where it does not.
    pub(super) fn kernel_multiply(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> CResult<Option<Multiply>> {
        if !self.kernel_applies(q, k, v)? {
            return Ok(None);
        }
        Ok(Some(
            self.bf16_products(q, k, v)?.unwrap_or(Multiply::Exact),
        ))
    }

    /// Whether the CPU kernel ([`kernel`]) runs the op: f32/f64 on the CPU with the softmax in the
    /// model's dtype, keys and values shaped like q's heads, and earlier keys' gradients it can add
    /// into (contiguous buffers long enough, sharing no storage with each other or the inputs).
    /// Elsewhere the tensor-op path runs, which reports what does not fit.
    pub(super) fn kernel_applies(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<bool> {
        let on_cpu = Backend::of(q) == Backend::Cpu && !KERNEL_OFF.with(|c| c.get());
        if !on_cpu || !host_float(q) || self.compute != q.dtype() {
            return Ok(false);
        }
        let (b, kv_heads, rows, hd) = q.dims4()?;
        // Keys and values in q's dtype, or bf16 ones for an f32 forward without earlier keys
        // (the kernel widens them a block at a time; the backward widens them whole).
        let stored = |t: &Tensor| {
            t.dtype() == q.dtype()
                || (t.dtype(), q.dtype()) == (DType::BF16, DType::F32) && self.earlier.is_none()
        };
        // The sequence length of a `[b, kv_heads, len, hd]` tensor like q's on the CPU.
        let heads_of = |t: &Tensor| match *t.dims() {
            [tb, tk, len, td] if (tb, tk, td) == (b, kv_heads, hd) => {
                (t.device().is_cpu() && stored(t)).then_some(len)
            }
            _ => None,
        };
        let pair = |a: &Tensor, b: &Tensor| {
            heads_of(a).filter(|&n| heads_of(b) == Some(n) && a.dtype() == b.dtype())
        };
        let own = pair(k, v);
        let sizes = rows > 0 && hd > 0 && self.group > 0 && rows % self.group == 0;
        let earlier = match &self.earlier {
            None => Some(0),
            Some(e) => {
                let ids =
                    [&e.grad_keys, &e.grad_values, q, k, v, &e.keys, &e.values].map(storage_id);
                let distinct = ids[0].is_some()
                    && ids[1].is_some()
                    && ids[0] != ids[1]
                    && ids[2..].iter().all(|id| *id != ids[0] && *id != ids[1]);
                let contiguous = e.grad_keys.is_contiguous() && e.grad_values.is_contiguous();
                match (pair(&e.keys, &e.values), pair(&e.grad_keys, &e.grad_values)) {
                    (Some(n), Some(len)) if e.offset + n <= len && distinct && contiguous => {
                        Some(n)
                    }
                    _ => None,
                }
            }
        };
        Ok(match (own, earlier) {
            (Some(t), Some(n)) => sizes && t + n > 0,
            _ => false,
        })
    }

    /// The kernel's sizes for queries `[b, kv_heads, rows, hd]`.
    pub(super) fn kernel_dims(
        &self,
        (b, kv_heads, rows, hd): (usize, usize, usize, usize),
    ) -> CResult<kernel::Dims> {
        Ok(kernel::Dims {
            items: b * kv_heads,
            kv_heads,
            rows,
            c: rows / self.group,
            hd,
        })
    }

    /// Key block `r` with its mask's data.
    pub(super) fn kernel_block<T: WithDType>(
        &self,
        dims: kernel::Dims,
        r: KeyRange,
    ) -> CResult<kernel::KeyBlock<T>> {
        let mask = match self.mask.bias(r.index, r.n, self.compute)? {
            // `[1 | b, 1, 1, c, n]`, as the kernel reads it (a mask that only broadcasts to it is
            // expanded; one that does not is an error).
            Some(m) => {
                let per_batch = m.dim(0)? > 1;
                let rows = if per_batch {
                    dims.items / dims.kv_heads
                } else {
                    1
                };
                let m = m.broadcast_as((rows, 1, 1, dims.c, r.n))?;
                Some((m.flatten_all()?.to_vec1::<T>()?, per_batch))
            }
            None => None,
        };
        Ok(kernel::KeyBlock {
            earlier: r.earlier,
            start: r.start,
            n: r.n,
            mask,
        })
    }

    /// [`Blocks::kernel_forward`] for the dtypes of q and the keys, timed.
    pub(super) fn timed_kernel_forward(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        multiply: Multiply,
    ) -> CResult<(Tensor, Normalizer)> {
        op_times::timed("attention.forward.kernel", q.device(), || {
            match (q.dtype(), k.dtype()) {
                (DType::F32, DType::BF16) => {
                    self.kernel_forward::<f32, half::bf16>(q, k, v, multiply)
                }
                (DType::F32, _) => self.kernel_forward::<f32, f32>(q, k, v, multiply),
                _ => self.kernel_forward::<f64, f64>(q, k, v, multiply),
            }
        })
    }

    /// [`Blocks::forward`] by the CPU kernel.
    pub(super) fn kernel_forward<T: KernelFloat, K: WithDType + kernel::Stored<T>>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        multiply: Multiply,
    ) -> CResult<(Tensor, Normalizer)> {
        let dims = self.kernel_dims(q.dims4()?)?;
        let data = HostKeys::new(q, k, v, self.earlier.as_ref())?;
        let fwd = data.read::<T, K, _>((dims, multiply), |inputs| {
            self.kernel_forward_of(inputs, k.dim(2)?)
        })?;
        let device = q.device();
        let normalizer = self.normalizer_of(&fwd, q.dims4()?, device)?;
        Ok((Tensor::from_vec(fwd.out, q.shape(), device)?, normalizer))
    }

    /// The CPU kernel's forward of `inputs`, with `own` keys of the op's own.
    pub(super) fn kernel_forward_of<T: KernelFloat, K: kernel::Stored<T>>(
        &self,
        inputs: &kernel::Inputs<'_, T, K>,
        own: usize,
    ) -> CResult<kernel::Forward<T>> {
        let ranges = self.ranges(own)?;
        let fetch = |b: usize| self.kernel_block::<T>(inputs.dims, ranges[b]);
        let blocks = kernel::Blocks {
            count: ranges.len(),
            fetch: &fetch,
        };
        kernel::forward(inputs, blocks)
    }

    /// The normalizer of the kernel's forward `fwd` of queries `[b, kv_heads, rows, hd]`.
    pub(super) fn normalizer_of<T: WithDType>(
        &self,
        fwd: &kernel::Forward<T>,
        (b, kv_heads, rows, _): (usize, usize, usize, usize),
        device: &candle_core::Device,
    ) -> CResult<Normalizer> {
        let per_query = (b, kv_heads, self.group, rows / self.group, 1);
        Ok(Normalizer {
            max: Tensor::from_slice(&fwd.max, per_query, device)?,
            log_sum: Tensor::from_slice(&fwd.log_sum, per_query, device)?,
        })
    }

    /// The op's backward by the CPU kernel on its inputs' storages (q contiguous; k and v, in q's
    /// dtype, with each head's rows contiguous) and the earlier keys and values (the same): the
    /// gradients of q and of the op's own keys and values; the earlier keys' are added into their
    /// buffers.
    pub(super) fn kernel_backward<T: KernelFloat>(
        &self,
        [(qs, ql), (ks, kl), (vs, vl)]: [(&CpuStorage, &Layout); 3],
        earlier: Option<&(Tensor, Tensor)>,
        (out, normalizer, grad): (&Tensor, &Normalizer, &Tensor),
        multiply: Multiply,
    ) -> CResult<(Vec<T>, Vec<T>, Vec<T>)> {
        let dims = self.kernel_dims(ql.shape().dims4()?)?;
        let t = kl.shape().dims4()?.2;
        let ranges = self.ranges(t)?;
        let fetch = |b: usize| self.kernel_block::<T>(dims, ranges[b]);
        let q = input_data::<T>(qs, ql)?;
        let own = kernel::KeysValues {
            keys: cpu_head_rows::<T>(ks, kl)?,
            values: cpu_head_rows::<T>(vs, vl)?,
        };
        let per_query = |x: &Tensor| x.flatten_all()?.to_vec1::<T>();
        let (max, log_sum) = (per_query(&normalizer.max)?, per_query(&normalizer.log_sum)?);
        let (out, grad) = (out.contiguous()?, grad.contiguous()?);
        let (out_guard, grad_guard) = (out.storage_and_layout(), grad.storage_and_layout());
        let out_data = host_slice::<T>(&out_guard.0, out_guard.1)?;
        let grad_data = host_slice::<T>(&grad_guard.0, grad_guard.1)?;
        let mut dq = vec![T::zero(); dims.items * dims.rows * dims.hd];
        let (mut dk, mut dv) = (
            vec![T::zero(); dims.items * t * dims.hd],
            vec![T::zero(); dims.items * t * dims.hd],
        );
        let mut run = |earlier_grads: Option<kernel::KeyGrads<'_, T>>| {
            with_earlier(earlier, |earlier_keys| {
                let inputs = kernel::Inputs {
                    dims,
                    q,
                    own,
                    earlier: earlier_keys,
                    multiply,
                };
                let blocks = kernel::Blocks {
                    count: ranges.len(),
                    fetch: &fetch,
                };
                let grads = kernel::Grads {
                    dq: &mut dq,
                    own: kernel::KeyGrads {
                        keys: &mut dk,
                        values: &mut dv,
                        len: t,
                        offset: 0,
                    },
                    earlier: earlier_grads,
                };
                kernel::backward(
                    &inputs,
                    blocks,
                    (out_data, &max, &log_sum),
                    grad_data,
                    grads,
                )
            })
        };
        match &self.earlier {
            None => run(None)?,
            Some(e) => {
                let len = e.grad_keys.dim(2)?;
                let offset = e.offset;
                let added = with_data_mut::<T, _>(&e.grad_keys, |gk, gk_layout| {
                    with_data_mut::<T, _>(&e.grad_values, |gv, gv_layout| {
                        run(Some(kernel::KeyGrads {
                            keys: view_mut(gk, gk_layout)?,
                            values: view_mut(gv, gv_layout)?,
                            len,
                            offset,
                        }))
                    })
                })?;
                if added.flatten().is_none() {
                    candle_core::bail!("attention kernel: earlier keys' gradients not on the CPU");
                }
            }
        }
        Ok((dq, dk, dv))
    }
}

impl Attention {
    /// The forward by the CPU kernel on the op's inputs (q contiguous, unscaled, in the layer's
    /// layout where the op is over heads; k and v with each head's rows contiguous): the output,
    /// the normalizer and the inner output left in [`Attention::saved`].
    pub(super) fn kernel_fwd(
        &self,
        multiply: Multiply,
        earlier: Option<&(Tensor, Tensor)>,
        [q, k, v]: [(&CpuStorage, &Layout); 3],
    ) -> CResult<(CpuStorage, Shape)> {
        match (q.0, k.0) {
            (CpuStorage::F32(_), CpuStorage::BF16(_)) => {
                self.kernel_fwd_as::<f32, half::bf16>(multiply, earlier, [q, k, v])
            }
            (CpuStorage::F32(_), CpuStorage::F32(_)) => {
                self.kernel_fwd_as::<f32, f32>(multiply, earlier, [q, k, v])
            }
            (CpuStorage::F64(_), CpuStorage::F64(_)) => {
                self.kernel_fwd_as::<f64, f64>(multiply, earlier, [q, k, v])
            }
            _ => candle_core::bail!("attention kernel: q and keys in other dtypes"),
        }
    }

    /// [`Attention::kernel_fwd`] for q in `T` and keys in `K`.
    pub(super) fn kernel_fwd_as<T: KernelFloat, K: WithDType + kernel::Stored<T>>(
        &self,
        multiply: Multiply,
        earlier: Option<&(Tensor, Tensor)>,
        [(qs, ql), (ks, kl), (vs, vl)]: [(&CpuStorage, &Layout); 3],
    ) -> CResult<(CpuStorage, Shape)> {
        let b = &self.blocks;
        let (batch, heads, c, hd) = ql.shape().dims4()?;
        let (_, kv_heads, own, _) = kl.shape().dims4()?;
        let inner = match self.over_heads {
            true => (batch, kv_heads, heads / kv_heads.max(1) * c, hd),
            false => (batch, heads, c, hd),
        };
        let q = input_data::<T>(qs, ql)?;
        // The exact products take q scaled, as candle's `affine` scales it (`x·s + 0`).
        let scaled: Vec<T>;
        let q = match multiply {
            Multiply::Exact if b.scale != 1.0 => {
                let (s, zero) = (T::from_f64(b.scale), T::from_f64(0.0));
                scaled = q.iter().map(|&x| x * s + zero).collect();
                &scaled
            }
            _ => q,
        };
        let own_keys = kernel::KeysValues {
            keys: cpu_head_rows::<K>(ks, kl)?,
            values: cpu_head_rows::<K>(vs, vl)?,
        };
        let dims = b.kernel_dims(inner)?;
        let fwd = with_earlier(earlier, |earlier| {
            let inputs = kernel::Inputs {
                dims,
                q,
                own: own_keys,
                earlier,
                multiply,
            };
            b.kernel_forward_of(&inputs, own)
        })?;
        let normalizer = b.normalizer_of(&fwd, inner, &Device::Cpu)?;
        let (out, shape, inner_out) = match self.over_heads {
            true => {
                let out = HeadsLayout::outer_data(&fwd.out, (batch, heads, c, hd));
                let inner_out = Tensor::from_vec(fwd.out, inner, &Device::Cpu)?;
                (out, Shape::from((batch, c, heads * hd)), Some(inner_out))
            }
            false => (fwd.out, ql.shape().clone(), None),
        };
        let saved = Saved {
            stats: Stats::Blocks(normalizer),
            inner_out,
        };
        *self.saved.lock().map_err(|_| poisoned())? = Some(saved);
        Ok((T::to_cpu_storage_owned(out), shape))
    }
}

/// The contiguous elements of a tensor's view in its storage (the earlier keys' gradients).
pub(super) fn view_mut<'a, T>(data: &'a mut [T], layout: &Layout) -> CResult<&'a mut [T]> {
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("attention kernel: gradient not contiguous".into())
    })?;
    Ok(&mut data[start..end])
}

/// The kernel's inputs, read in place: q contiguous, keys and values with each head's rows
/// contiguous (a chunk's keys narrowed from the sequence's are not copied).
pub(super) struct HostKeys {
    q: Tensor,
    own: (Tensor, Tensor),
    earlier: Option<(Tensor, Tensor)>,
}

/// `t` (`[b, heads, len, hd]`) itself where each head's rows are contiguous, else a contiguous copy.
pub(super) fn rows_contiguous(t: &Tensor) -> CResult<Tensor> {
    match rows_are_contiguous(t) {
        true => Ok(t.clone()),
        false => t.contiguous(),
    }
}

/// The head rows of `t`'s view in its (read-locked) storage.
pub(super) fn head_rows<'a, T: WithDType>(
    storage: &'a candle_core::Storage,
    layout: &Layout,
) -> CResult<kernel::HeadRows<'a, T>> {
    let candle_core::Storage::Cpu(cpu) = storage else {
        candle_core::bail!("attention kernel: not on the CPU");
    };
    cpu_head_rows(cpu, layout)
}

/// The head rows of a `[b, heads, len, hd]` view in CPU storage, each head's rows contiguous.
pub(super) fn cpu_head_rows<'a, T: WithDType>(
    cpu: &'a CpuStorage,
    layout: &Layout,
) -> CResult<kernel::HeadRows<'a, T>> {
    if !rows_contiguous_in(layout.dims(), layout.stride()) {
        candle_core::bail!("attention kernel: head rows not contiguous");
    }
    Ok(kernel::HeadRows {
        data: &cpu.as_slice::<T>()?[layout.start_offset()..],
        batch_stride: layout.stride()[0],
        head_stride: layout.stride()[1],
    })
}

impl HostKeys {
    pub(super) fn new(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        earlier: Option<&EarlierKeys>,
    ) -> CResult<Self> {
        let earlier = match earlier {
            Some(e) => Some((rows_contiguous(&e.keys)?, rows_contiguous(&e.values)?)),
            None => None,
        };
        Ok(Self {
            q: q.contiguous()?,
            own: (rows_contiguous(k)?, rows_contiguous(v)?),
            earlier,
        })
    }

    /// Runs `f` on the kernel's inputs, the storages read-locked meanwhile.
    pub(super) fn read<T: KernelFloat, K: WithDType, R>(
        &self,
        (dims, multiply): (kernel::Dims, Multiply),
        f: impl FnOnce(&kernel::Inputs<'_, T, K>) -> CResult<R>,
    ) -> CResult<R> {
        let q = self.q.storage_and_layout();
        let (k, v) = (
            self.own.0.storage_and_layout(),
            self.own.1.storage_and_layout(),
        );
        let own = kernel::KeysValues {
            keys: head_rows::<K>(&k.0, k.1)?,
            values: head_rows::<K>(&v.0, v.1)?,
        };
        let q = host_slice::<T>(&q.0, q.1)?;
        with_earlier(self.earlier.as_ref(), |earlier| {
            let inputs = kernel::Inputs {
                dims,
                q,
                own,
                earlier,
                multiply,
            };
            f(&inputs)
        })
    }
}

/// Runs `f` on the earlier keys and values (`[b, kv_heads, n, hd]`, each head's rows contiguous),
/// their storages read-locked meanwhile.
pub(super) fn with_earlier<K: WithDType, R>(
    earlier: Option<&(Tensor, Tensor)>,
    f: impl FnOnce(Option<kernel::KeysValues<'_, K>>) -> CResult<R>,
) -> CResult<R> {
    let Some((k, v)) = earlier else {
        return f(None);
    };
    let (k, v) = (k.storage_and_layout(), v.storage_and_layout());
    f(Some(kernel::KeysValues {
        keys: head_rows::<K>(&k.0, k.1)?,
        values: head_rows::<K>(&v.0, v.1)?,
    }))
}

/// Whether each head's rows of `t` (`[b, heads, len, hd]`) are contiguous.
pub(super) fn rows_are_contiguous(t: &Tensor) -> bool {
    rows_contiguous_in(t.dims(), t.stride())
}

/// Whether each head's rows of a `[b, heads, len, hd]` view with these strides are contiguous (a
/// dimension of one element may have any stride, as candle lays such views out).
pub(super) fn rows_contiguous_in(dims: &[usize], stride: &[usize]) -> bool {
    match (dims, stride) {
        (&[_, _, len, hd], &[_, _, row, col]) => (len <= 1 || row == hd) && (hd <= 1 || col == 1),
        _ => false,
    }
}
