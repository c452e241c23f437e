//! Greedy decoding without a cache (recomputes the prefix each token, one prompt at a time): the plain
//! reference the KV-cache decoders (`sampling`, `streambp_models::decode`) are tested against.

use candle_core::{Device, Tensor, D};
use streambp_models::Model;

use crate::Result;

/// Greedy continuation of `prompt` until `eos` or `max_new` tokens (eos excluded from the result).
pub fn greedy(model: &Model, prompt: &[u32], eos: u32, max_new: usize) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(crate::TrainError::Internal(
            "greedy decoding needs a prompt of at least one token".into(),
        ));
    }
    let model = model.detached();
    let mut ids = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..max_new {
        let input = Tensor::new(ids.as_slice(), &Device::Cpu)?
            .to_device(model.device())?
            .unsqueeze(0)?;
        let logits = model.forward(&input, None)?;
        let last = logits.narrow(1, ids.len() - 1, 1)?.squeeze(1)?.squeeze(0)?;
        let next = last.argmax(D::Minus1)?.to_scalar::<u32>()?;
        if next == eos {
            break;
        }
        out.push(next);
        ids.push(next);
    }
    Ok(out)
}
