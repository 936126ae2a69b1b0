use crate::sampler::log_softmax;
use ferrotron_model::{GptModel, KvCache, LogitsMode, ModelError};

/// Per-token log-probabilities of a text under the model.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Score {
    /// `log p(ids[t+1] | ids[..=t])` for `t = 0..n-1` (natural log).
    pub token_logprobs: Vec<f32>,
    /// Mean negative log-likelihood over the predicted tokens, nats: the loss transformers
    /// returns with `labels = input_ids`.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
}

/// Scores `ids` (at least two tokens) with one full forward pass.
pub fn score(model: &GptModel, ids: &[u32]) -> Result<Score, ModelError> {
    if ids.len() < 2 {
        return Err(ModelError::Input(format!(
            "scoring needs at least 2 tokens, the text has {}",
            ids.len()
        )));
    }
    let mut cache = KvCache::new(model.config(), 1, ids.len())?;
    let logits = model.forward(ids, &mut cache, LogitsMode::All)?;
    let v = model.config().vocab_size;
    let mut lp = vec![0f32; v];
    let token_logprobs: Vec<f32> = (0..ids.len() - 1)
        .map(|t| {
            log_softmax(&logits[t * v..(t + 1) * v], &mut lp);
            lp[ids[t + 1] as usize]
        })
        .collect();
    let loss = -token_logprobs.iter().map(|&x| x as f64).sum::<f64>() / token_logprobs.len() as f64;
    Ok(Score {
        token_logprobs,
        loss,
        perplexity: loss.exp(),
    })
}
