//! Sampling with a KV cache (`streambp_models::decode`): groups of completions of prompts (GRPO's
//! rollouts), with temperature and top-p, each row stopping at EOS; all of a micro-batch's rows in one
//! forward per new token, as transformers' `generate` runs TRL's.

use candle_core::{DType, Device, Tensor};
use streambp_models::decode::KvCache;
use streambp_models::init::NormalRng;
use streambp_models::Model;

use crate::Result;

/// How completions are sampled.
#[derive(Debug, Clone, Copy)]
pub struct SamplingConfig {
    /// Logits are divided by this before the softmax (0 or below: greedy).
    pub temperature: f64,
    /// Nucleus sampling: draw from the smallest set of tokens with at least this probability mass.
    pub top_p: f64,
    /// Longest completion in tokens; a row that emits no EOS stops here.
    pub max_new_tokens: usize,
}

/// Draws a token from `logits` with temperature and nucleus (top-p) sampling; temperature 0 is greedy.
fn draw(logits: &[f32], cfg: &SamplingConfig, rng: &mut NormalRng) -> u32 {
    if cfg.temperature <= 0.0 {
        return argmax(logits);
    }
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, (((l - max) as f64) / cfg.temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= total);
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    let mut kept = 0;
    let mut mass = 0.0;
    for p in &probs {
        kept += 1;
        mass += p.1;
        if mass >= cfg.top_p {
            break;
        }
    }
    let u = rng.uniform() * mass;
    let mut acc = 0.0;
    for p in &probs[..kept] {
        acc += p.1;
        if u <= acc {
            return p.0;
        }
    }
    probs[kept - 1].0
}

/// The index of the largest value, the first of equal ones (as candle's `argmax` and torch's).
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if x.total_cmp(&v[best]).is_gt() {
            best = i;
        }
    }
    best as u32
}

/// `rows` sampled completions of `prompt` (token ids, EOS excluded; a row that never emits EOS stops at
/// `max_new_tokens`).
pub fn sample_group(
    model: &Model,
    prompt: &[u32],
    rows: usize,
    eos: u32,
    cfg: &SamplingConfig,
    rng: &mut NormalRng,
) -> Result<Vec<Vec<u32>>> {
    let mut groups = sample_groups(model, &[prompt], rows, eos, cfg, std::slice::from_mut(rng))?;
    Ok(groups.pop().unwrap_or_default())
}

/// `group` sampled completions of each of `prompts` (as [`sample_group`]), decoded together (in
/// batches of at most [`SAMPLE_BATCH_TOKENS`]): one forward per new token for every row of a batch,
/// prompts left-padded to the longest. Prompt `p`'s rows draw
/// from `rngs[p]` in the order sampling it alone would (its rows in turn at each new token, until all
/// of them stopped), so what a prompt draws does not depend on the prompts beside it.
pub fn sample_groups(
    model: &Model,
    prompts: &[&[u32]],
    group: usize,
    eos: u32,
    cfg: &SamplingConfig,
    rngs: &mut [NormalRng],
) -> Result<Vec<Vec<Vec<u32>>>> {
    if rngs.len() != prompts.len() {
        return Err(crate::TrainError::Internal(format!(
            "sampling {} prompts with {} generators",
            prompts.len(),
            rngs.len()
        )));
    }
    if prompts.is_empty() || group == 0 {
        return Ok(vec![Vec::new(); prompts.len()]);
    }
    if prompts.iter().any(|p| p.is_empty()) {
        return Err(crate::TrainError::Internal(
            "sampling needs prompts of at least one token".into(),
        ));
    }
    let model = model.detached();
    let mut out = Vec::with_capacity(prompts.len());
    let mut first = 0;
    while first < prompts.len() {
        let widths = prompts[first..]
            .iter()
            .map(|p| p.len() + cfg.max_new_tokens);
        let n = items_within(widths, group, SAMPLE_BATCH_TOKENS);
        let range = first..first + n;
        let batch = (&prompts[range.clone()], &mut rngs[range]);
        out.extend(sample_batch(&model, batch, group, eos, cfg)?);
        first += n;
    }
    Ok(out)
}

/// Rows decoded together at most, in padded tokens (prompt and completion): bounds the KV cache and
/// the rows of logits copied to the host at each new token. Prompts beyond it are decoded in further
/// batches, which draw what one batch would (each prompt has its own generator).
pub const SAMPLE_BATCH_TOKENS: usize = 16384;

/// How many of the leading items (at least one) one decoding batch of `budget` padded tokens holds:
/// item `i` takes `rows_each` rows of `widths[i]` tokens (prompt and new tokens), every row padded
/// to the widest of the batch.
pub fn items_within(
    widths: impl IntoIterator<Item = usize>,
    rows_each: usize,
    budget: usize,
) -> usize {
    let mut widest = 0;
    let mut n = 0;
    for width in widths {
        widest = width.max(widest);
        if n > 0 && (n + 1) * rows_each * widest > budget {
            break;
        }
        n += 1;
    }
    n.max(1)
}

/// [`sample_groups`] of prompts decoded in one batch.
fn sample_batch(
    model: &Model,
    (prompts, rngs): (&[&[u32]], &mut [NormalRng]),
    group: usize,
    eos: u32,
    cfg: &SamplingConfig,
) -> Result<Vec<Vec<Vec<u32>>>> {
    let device: &Device = model.device();
    let rows: Vec<&[u32]> = prompts
        .iter()
        .flat_map(|p| std::iter::repeat_n(*p, group))
        .collect();
    let (mut cache, ids) = KvCache::left_padded(model, &rows, eos, cfg.max_new_tokens)?;
    let mut logits = cache.step(model, &ids)?;
    let mut out = vec![Vec::new(); rows.len()];
    let mut done = vec![false; rows.len()];
    let mut next = vec![eos; rows.len()];
    for t in 0..cfg.max_new_tokens {
        let rows_logits = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for (p, rng) in rngs.iter_mut().enumerate() {
            let span = p * group..(p + 1) * group;
            // A group whose rows all stopped draws no more, as when it is sampled alone.
            if done[span.clone()].iter().all(|&d| d) {
                continue;
            }
            for r in span {
                next[r] = draw(&rows_logits[r], cfg, rng);
                if done[r] {
                    continue;
                }
                if next[r] == eos {
                    done[r] = true;
                } else {
                    out[r].push(next[r]);
                }
            }
        }
        if done.iter().all(|&d| d) || t + 1 == cfg.max_new_tokens {
            break;
        }
        // Finished rows keep feeding EOS; their tokens are ignored.
        let feed: Vec<u32> = next
            .iter()
            .zip(&done)
            .map(|(&tok, &d)| if d { eos } else { tok })
            .collect();
        logits = cache.step(model, &Tensor::new(feed.as_slice(), device)?.unsqueeze(1)?)?;
    }
    let mut rows = out.into_iter();
    Ok(prompts
        .iter()
        .map(|_| rows.by_ref().take(group).collect())
        .collect())
}
