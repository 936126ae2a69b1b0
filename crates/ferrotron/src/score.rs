use crate::model_dir::{LoadedModel, WeightDtype};
use anyhow::Result;
use clap::Args;
use ferrotron_infer::score;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct ScoreArgs {
    /// HF model directory (config.json, safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// The text to score (tokenized with the model's tokenizer, special tokens added as HF does).
    #[arg(long)]
    text: String,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Weight storage in memory (compute stays f32).
    #[arg(long, value_enum, default_value_t = WeightDtype::F32)]
    dtype: WeightDtype,
}

pub fn run(args: ScoreArgs) -> Result<ExitCode> {
    let loaded = LoadedModel::load(&args.model, args.dtype)?;
    let tok = &loaded.tokenizer;
    let ids = tok.encode(&args.text, true)?;
    let s = score(&loaded.model, &ids)?;
    if args.json {
        let tokens: Vec<String> = ids
            .iter()
            .map(|&i| tok.decode(&[i], false).unwrap_or_default())
            .collect();
        println!(
            "{}",
            json!({"input_ids": ids, "tokens": tokens, "token_logprobs": s.token_logprobs,
                   "loss": s.loss, "perplexity": s.perplexity})
        );
    } else {
        println!("{:>6}  {:>10}  token", "pos", "logprob");
        for (t, lp) in s.token_logprobs.iter().enumerate() {
            let piece = tok.decode(&[ids[t + 1]], false)?;
            println!("{:>6}  {:>10.4}  {:?}", t + 1, lp, piece);
        }
        println!(
            "loss {:.6} nats/token, perplexity {:.4} over {} tokens",
            s.loss,
            s.perplexity,
            s.token_logprobs.len()
        );
    }
    Ok(ExitCode::SUCCESS)
}
