//! The cost model's arithmetic: [`estimate`] of a problem and its chunks, one function per phase of
//! the streamed backward over the sizes they share, and the terms that differ between the host and
//! an accelerator in one table per device ([`DeviceTerms`]).

use candle_core::DType;
use streambp_kernels::ops::attention::memory as attention;
use streambp_kernels::ops::linear;
use streambp_kernels::ops::matmul::{self, Product};
use streambp_kernels::Backend;

use super::{adapter_count, checkpoint_counts, parameter_count, Chunks, Estimate, Problem};

const F32: u64 = 4;

/// The terms of the model that differ by device. The host's are fitted to peaks measured exactly
/// with the counting allocator (docs/benchmarks.md, "The planner's cost model"); an accelerator's
/// are the composed tensor ops' counts, erring high where no card has measured them yet.
struct DeviceTerms {
    /// The attention op's backend.
    backend: Backend,
    /// f32-sized logits buffers a head chunk holds at once: one on the host, which its softmax and
    /// the softmax's VJP overwrite; four for the composed ops (scores, softmax, VJP, scatter).
    logits_buffers: u64,
    /// The per-chunk share of the head weight's gradient is a buffer of its own (the composed ops;
    /// still counted on the card, whose cuBLAS product now adds into the accumulator, until a card
    /// measures it: the head's phase is fitted to a card's peak of the composed ops); on the host
    /// the product adds it into the accumulator.
    head_share_buffer: bool,
    /// A chunk's attention and MLP gradient moments overlap: measured apart on the host, summed
    /// elsewhere to err high.
    moments_overlap: bool,
    /// gemm's packing slabs and workspace count (the host's products).
    gemm: bool,
    /// Half-precision layers run in f32 (`DecoderLayer::computed_in_f32`, the host only).
    half_in_f32: bool,
    /// `[rows, V]` buffers a logits chunk holds beside the softmax's for an objective that reads
    /// the entropies: none on the host, whose passes keep the entropies' terms per row; five for
    /// the composed ops (fitted on the host before its passes: log-probabilities, their
    /// exponentials and the gradient's terms).
    entropy_buffers: u64,
}

/// The host CPU's terms.
const HOST: DeviceTerms = DeviceTerms {
    backend: Backend::Cpu,
    logits_buffers: 1,
    head_share_buffer: false,
    moments_overlap: false,
    gemm: true,
    half_in_f32: true,
    entropy_buffers: 0,
};

/// An accelerator's terms (CUDA).
const CARD: DeviceTerms = DeviceTerms {
    backend: Backend::Cuda,
    logits_buffers: 4,
    head_share_buffer: true,
    moments_overlap: true,
    gemm: false,
    half_in_f32: false,
    entropy_buffers: 5,
};

/// The sizes every phase reads, in elements and bytes.
struct Sizes<'a> {
    p: Problem<'a>,
    device: &'static DeviceTerms,
    /// Bytes of the model's dtype.
    e: u64,
    half: bool,
    b: u64,
    t: u64,
    d: u64,
    q: u64,
    kv: u64,
    ffn: u64,
    vocab: u64,
    /// The layer chunk and the logits chunk, at most `T`.
    c: u64,
    lc: u64,
    /// Bytes of an activation of a layer (f32 for half precision computed in f32).
    act: u64,
    /// `[b, T, d]` hidden states.
    hidden: u64,
    /// Parameters of one layer.
    layer_params: u64,
}

impl<'a> Sizes<'a> {
    fn new(p: Problem<'a>, chunks: Chunks) -> Self {
        let cfg = p.config;
        let device = if p.host { &HOST } else { &CARD };
        let e = p.dtype.size_in_bytes() as u64;
        let half = e < 4;
        let (b, t) = (p.batch as u64, p.seq_len as u64);
        let (d, vocab) = (cfg.hidden_size as u64, cfg.vocab_size as u64);
        let layers = cfg.num_layers() as u64;
        Self {
            p,
            device,
            e,
            half,
            b,
            t,
            d,
            q: (cfg.num_heads * cfg.head_dim) as u64,
            kv: (cfg.num_kv_heads * cfg.head_dim) as u64,
            ffn: cfg.intermediate_size as u64,
            vocab,
            c: (chunks.chunk as u64).min(t),
            lc: (chunks.logits_chunk as u64).min(t),
            act: if half && device.half_in_f32 { F32 } else { e },
            hidden: b * t * d * e,
            layer_params: parameter_count(cfg).saturating_sub(vocab * d) / layers.max(1),
        }
    }

    /// The largest packing workspace of `products` on the host (none elsewhere).
    fn workspace(&self, products: &[Product], tiled: bool) -> u64 {
        let elem = self.e.max(F32) as usize; // the host runs half-precision products in f32
        match self.device.gemm {
            true => products
                .iter()
                .map(|&pr| matmul::workspace(pr, elem, tiled))
                .max()
                .unwrap_or(0),
            false => 0,
        }
    }

    /// The host's workspace for a chunk's projections ([`linear::host_workspace`]; none
    /// elsewhere).
    fn projection_workspace(&self) -> u64 {
        let (d, q, kv, ffn) = (
            self.d as usize,
            self.q as usize,
            self.kv as usize,
            self.ffn as usize,
        );
        let shapes = [(q, d), (kv, d), (d, q), (ffn, d), (d, ffn)];
        let elem = self.e.max(F32) as usize; // the host runs half-precision products in f32
        match self.device.gemm {
            true => {
                let rows = (self.b * self.c) as usize;
                linear::host_workspace(rows, &shapes, self.p.lora.is_none(), elem)
            }
            false => 0,
        }
    }

    /// `[c, d | q | kv | ffn]` rows of a chunk, so many of each (counts fitted, see the module
    /// docs), in the layer's activation dtype.
    fn chunk_rows(&self, (of_d, of_q, of_kv, of_ffn): (u64, u64, u64, u64)) -> u64 {
        let (d, q, kv, ffn) = (self.d, self.q, self.kv, self.ffn);
        self.b * self.c * (of_d * d + of_q * q + of_kv * kv + of_ffn * ffn) * self.act
    }

    /// A frozen model's per-token states (a teacher's final hidden states), held through the
    /// forward and the head.
    fn frozen_states(&self) -> u64 {
        self.b * self.t * self.p.frozen.per_token
    }

    /// The layer's keys and values of the whole sequence, in its activation dtype.
    fn keys_values(&self) -> u64 {
        2 * self.b * self.t * self.kv * self.act
    }

    /// The layer in flight's weights widened to f32 for the phase (half precision in f32).
    fn widened_layer(&self) -> u64 {
        match self.half && self.device.half_in_f32 {
            true => self.layer_params * F32,
            false => 0,
        }
    }

    /// The attention op's sizes for the chunk.
    fn attention(&self) -> attention::Sizes {
        let cfg = self.p.config;
        attention::Sizes {
            batch: self.b,
            heads: cfg.num_heads as u64,
            kv_heads: cfg.num_kv_heads as u64,
            head_dim: cfg.head_dim as u64,
            queries: self.c,
            keys: self.t,
            element: self.act,
            threads: rayon::current_num_threads() as u64,
        }
    }
}

/// The parameters and their gradient accumulators.
struct Held {
    weights: u64,
    /// Every accumulator while the layers' backward runs.
    grads: u64,
    /// Once the layers are done (only the table's accumulator still in f32).
    grads_after_layers: u64,
    /// The head's (the table's when tied), made in the head.
    head_grad: u64,
    /// The table in the model dtype beside its accumulator.
    table_grad: u64,
}

impl Held {
    /// Full fine-tuning: weights, and gradients made as the backward reaches them (f32 for half
    /// precision, rounded to the model dtype once a layer is done: f32 only for the layer in
    /// flight and the table). LoRA: the frozen weights, and the adapters with their gradients (f32,
    /// or f64 for an f64 model); the head's and the table's gradients never exist.
    fn new(s: &Sizes) -> Self {
        let (e, table) = (s.e, s.vocab * s.d);
        let params = parameter_count(s.p.config);
        let grad_bytes = if s.half { F32 } else { e };
        let in_flight = s.layer_params + table;
        match s.p.lora {
            None => Self {
                weights: params * e,
                grads: params * e + in_flight * (grad_bytes - e),
                grads_after_layers: params * e + table * (grad_bytes - e),
                head_grad: table * grad_bytes,
                table_grad: table * (e + grad_bytes),
            },
            Some(lora) => {
                let adapters = adapter_count(s.p.config, lora) * F32.max(e);
                Self {
                    weights: params * e + adapters,
                    grads: adapters,
                    grads_after_layers: adapters,
                    head_grad: 0,
                    table_grad: 0,
                }
            }
        }
    }
}

/// The checkpoints on the device in each phase: one per segment of `K` layers and the last output
/// at the forward's end and in the head (`L + 1` for `K = 1`); in the layers' backward the segments
/// not yet reached and the inputs of the one in flight, recomputed from its stored one (`L` at the
/// start for `K = 1`). Offloaded, the stored ones are elsewhere and the device holds the last
/// output, then the segment in flight.
struct Checkpoints {
    forward: u64,
    head: u64,
    layers: u64,
}

impl Checkpoints {
    fn new(s: &Sizes) -> Self {
        let hidden = s.hidden;
        let counts = checkpoint_counts(s.p.config.num_layers(), s.p.checkpoint_every);
        // On the CPU only the disk tier offloads; its read-ahead holds the next checkpoint's bytes.
        let read_ahead = u64::from(s.p.offloaded && s.p.host);
        match s.p.offloaded {
            true => Self {
                forward: hidden,
                head: hidden,
                layers: (counts.segment + read_ahead) * hidden,
            },
            false => Self {
                forward: counts.forward * hidden,
                head: counts.head * hidden,
                layers: counts.backward * hidden,
            },
        }
    }
}

/// The cost model of `stream` with the given chunk sizes.
pub fn estimate(p: Problem, chunks: Chunks) -> Estimate {
    let s = Sizes::new(p, chunks);
    let (held, checkpoints) = (Held::new(&s), Checkpoints::new(&s));
    Estimate {
        resident: resident(&s, &held),
        forward_phase: forward_phase(&s, &checkpoints),
        head_phase: head_phase(&s, &held, &checkpoints),
        layer_phase: layer_phase(&s, &held, &checkpoints),
        embedding_phase: embedding_phase(&s, &held),
    }
}

/// Held throughout: the weights, the rope tables (cos and sin for every position, built once per
/// backward), gemm's per-thread packing slabs on the host (kept for the process's life) and per
/// token the batch's ids, positions, targets and log-probs (fitted: 48 bytes).
fn resident(s: &Sizes, held: &Held) -> u64 {
    let rope = 2 * s.t * s.p.config.head_dim as u64 * s.e;
    let slabs = match s.device.gemm {
        true => matmul::thread_slabs(),
        false => 0,
    };
    let tokens = s.b * s.t * 48;
    held.weights + rope + slabs + tokens + s.p.frozen.bytes
}

/// The forward: the checkpoints, one layer's keys and values, a chunk's activations (no graph:
/// what one op of a chunk reads and writes, and what the layer keeps for later ops, the input and
/// the residual sum), its projections' workspace and, for a bf16 layer on the host, the attention
/// kernel's bf16 copies.
fn forward_phase(s: &Sizes, checkpoints: &Checkpoints) -> u64 {
    let bf16_forward = match (s.p.dtype, s.device.backend) {
        (DType::BF16, Backend::Cpu) => attention::bf16_forward_bytes(s.attention()),
        _ => 0,
    };
    checkpoints.forward
        + s.frozen_states()
        + s.keys_values()
        + s.chunk_rows((5, 4, 1, 4))
        + s.projection_workspace()
        + s.widened_layer()
        + bf16_forward
}

/// The head, per logits chunk of `b · lc` rows: the scores in the compute dtype, their softmax, its
/// VJP and the target scatter (on the host the scores alone, which their softmax and its VJP
/// overwrite; a bf16 head's logits and their gradient are f32 holding bf16 values, which its
/// products read as bf16; a head that casts instead, f16, soft-capped or a score head, adds the
/// half-precision copy each cast makes; elsewhere half precision adds the raw logits, the rounded
/// VJP and temporaries, fitted); the chunk's `[lc, d]` rows; its share of the head weight's
/// gradient; each chunk's log-probs until they are joined (fitted: 320 bytes); the products'
/// workspace.
fn head_phase(s: &Sizes, held: &Held, checkpoints: &Checkpoints) -> u64 {
    let (b, lc, e) = (s.b, s.lc, s.e);
    let cast_head = !s.p.config.head_logits_as_bf16_values(s.p.dtype);
    let half_logits = match (s.half, s.p.host) {
        (true, false) => 4 * e,
        (true, true) if cast_head => e,
        _ => 0,
    };
    let logits = b * lc * s.vocab * (s.device.logits_buffers * F32.max(e) + half_logits);
    // The final norm's output and what its backward keeps, the hidden state's copy and gradient and
    // the norm's VJP (fitted: 7, at least f32's size: half precision's norm runs in f32), and one
    // more in half precision: its bf16 rows beside their f32 ones.
    let head_rows = b * lc * s.d * (7 * e.max(F32) + if s.half { e } else { 0 });
    let head_share = match s.device.head_share_buffer {
        true => held.head_grad,
        false => 0,
    };
    let rows = (b * lc) as usize;
    let (v, dd) = (s.vocab as usize, s.d as usize);
    let mut products = vec![
        Product::by_transposed(rows, v, dd),
        Product::by_plain(rows, v, dd),
    ];
    if held.head_grad > 0 {
        products.push(Product::transposed_by(v, dd, rows));
    }
    let parts = s.t.div_ceil(lc) * 320;
    held.head_grad
        + checkpoints.head
        + s.hidden
        + parts
        + logits
        + head_rows
        + head_share
        + s.frozen_states()
        + b * lc * s.p.frozen.per_logits_row
        + entropy_rows(s)
        + s.workspace(&products, true)
}

/// What the head holds per logits chunk for an objective that reads the entropies, beside the
/// softmax's own buffer ([`DeviceTerms::entropy_buffers`], in the head's compute dtype: 0.308 MiB
/// per row at V = 16,384 in f32 for the composed ops; docs/benchmarks.md, "GRPO's entropy terms in
/// the budget").
fn entropy_rows(s: &Sizes) -> u64 {
    match s.p.reads_entropy {
        true => s.device.entropy_buffers * s.b * s.lc * s.vocab * s.e.max(F32),
        false => 0,
    }
}

/// A layer's backward: the accumulators, the checkpoints, K and V with their pending gradients
/// (and, fitted at T = 64K, one more `[T, kv]` state), the incoming and outgoing `[b, T, d]`
/// gradients, the chunk's graph (every activation until its backward ends: the input, the norms,
/// the projections, q/k norms and rope, the attention's output, the residual sums) and its
/// gradients' busiest moment: the attention op's backward (its output's gradient, its inputs', the
/// inner-layout copies, the input's gradient so far, and its score tiles) or the MLP's (the gate's
/// and up projection's gradients beside the SwiGLU's and the residual's). Which is the larger
/// depends on the shape: one fitted sum for all of them under-estimated a wide `d`, `q`, `kv` or
/// `ffn` by up to 19%.
fn layer_phase(s: &Sizes, held: &Held, checkpoints: &Checkpoints) -> u64 {
    let kv_state = 5 * s.keys_values() / 2;
    let grads_io = 2 * s.hidden;
    let attention_moment = s.chunk_rows((1, 3, 3, 0));
    let mlp_moment = s.chunk_rows((4, 0, 0, 5));
    let scores = attention::backward_bytes(s.attention(), s.device.backend);
    let busiest_moment = match s.device.moments_overlap {
        false => (attention_moment + scores).max(mlp_moment),
        true => attention_moment + scores + mlp_moment,
    };
    held.grads
        + s.widened_layer()
        + checkpoints.layers
        + kv_state
        + grads_io
        + s.chunk_rows((7, 6, 6, 3))
        + busiest_moment
        + s.projection_workspace()
}

/// The embedding's VJP (written out): the incoming `[b, T, d]` gradient; on the host its rows go
/// into the table's accumulator in place (in half precision widened to f32 first); elsewhere they
/// make a table-sized sum in the model dtype (`index_add` onto zeros), copied to f32 in half
/// precision. Not tied, that sum (or its copy) becomes the table's accumulator, already counted in
/// `grads_after_layers`: one more model-dtype table comes on top, the zeros beside the sum or the
/// sum beside its copy (as a card measured: docs/benchmarks.md, "Checkpoint tiers on the card").
/// Tied, the accumulator holds the head's share already, and the scaled rows and the sum (with its
/// f32 copy) are added to it out of place, a new sum beside it (not yet measured on a card). Under
/// LoRA the gradient arrives and nothing is done with it. Gemma's embedding scale and a padding id
/// each make one more copy of the rows (not under LoRA).
fn embedding_phase(s: &Sizes, held: &Held) -> u64 {
    let cfg = s.p.config;
    let (hidden, table) = (s.hidden, s.vocab * s.d);
    let row_copies = match s.p.lora {
        None => cfg.embed_scale.is_some() as u64 + cfg.pad_token_id.is_some() as u64,
        Some(_) => 0,
    };
    held.grads_after_layers
        + row_copies * hidden
        + match (s.p.lora, s.p.host) {
            (Some(_), _) => hidden,
            (None, true) if s.half => hidden + s.b * s.t * s.d * F32,
            (None, true) => hidden,
            (None, false) if !cfg.tie_word_embeddings => hidden + table * s.e,
            (None, false) if s.half => 2 * hidden + held.table_grad + table * F32,
            (None, false) => 2 * hidden + held.table_grad,
        }
}
