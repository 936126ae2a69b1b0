use crate::model_dir::{LoadedModel, WeightDtype};
use anyhow::{Context, Result, bail};
use clap::Args;
use ferrotron_checkpoint::peft::PeftAdapter;
use ferrotron_data::StreamDecoder;
use ferrotron_data::chat::ChatMessage;
use ferrotron_infer::sampler::SamplingParams;
use ferrotron_infer::{GenerateOptions, Generation, generate};
use serde_json::json;
use std::io::{BufRead, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Args)]
pub struct GenerateArgs {
    /// HF model directory (config.json, safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// The prompt text (or use --input-file).
    #[arg(
        long,
        required_unless_present = "input_file",
        conflicts_with = "input_file"
    )]
    prompt: Option<String>,
    /// Wrap the prompt as a user turn in the model's chat template (tokenizer_config.json).
    #[arg(long)]
    chat: bool,
    /// System message for --chat (otherwise the template's default, if any).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Maximum tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Always pick the most likely token (the default unless a sampling flag is given).
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p"])]
    greedy: bool,
    /// Sample with this temperature (HF semantics; implies sampling).
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample from the K most likely tokens (0 = off; HF default 50 when sampling).
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample from the smallest set of tokens with probability mass >= P (1.0 = off).
    #[arg(long)]
    top_p: Option<f32>,
    /// Penalize tokens already present (HF repetition_penalty; 1.0 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object (prompt ids, generated ids, text, timing) instead of streaming.
    #[arg(long)]
    json: bool,
    /// Batch mode: a JSONL file with one {"prompt": ...} (optional "system") per line.
    #[arg(long, requires = "output_file")]
    input_file: Option<PathBuf>,
    /// Batch mode: where to write one JSON result per input line (written atomically).
    #[arg(long, requires = "input_file")]
    output_file: Option<PathBuf>,
    /// Weight storage in memory; bf16 halves memory traffic (compute stays f32).
    #[arg(long, value_enum, default_value_t = WeightDtype::F32)]
    dtype: WeightDtype,
    /// Generate with this LoRA adapter (a PEFT adapter directory for --model), computed as
    /// `ferrotron serve --lora NAME=DIR` serves it.
    #[arg(long, value_name = "DIR")]
    lora: Option<PathBuf>,
}

impl GenerateArgs {
    fn sampling(&self) -> Result<SamplingParams> {
        let sample = self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some();
        let d = SamplingParams::default();
        Ok(SamplingParams::new(
            !sample,
            self.temperature.unwrap_or(d.temperature),
            self.top_k.unwrap_or(d.top_k),
            self.top_p.unwrap_or(d.top_p),
            self.repetition_penalty,
            self.seed,
        )?)
    }
}

struct Runner {
    loaded: LoadedModel,
    options: GenerateOptions,
    chat: bool,
}

impl Runner {
    fn prompt_ids(&self, prompt: &str, system: Option<&str>) -> Result<Vec<u32>> {
        if !self.chat {
            return Ok(self.loaded.tokenizer.encode(prompt, true)?);
        }
        let template =
            self.loaded.chat_template.as_ref().context(
                "--chat: the model directory has no chat template in tokenizer_config.json",
            )?;
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(ChatMessage::new("system", s));
        }
        messages.push(ChatMessage::new("user", prompt));
        let text = template.render(&messages, true)?;
        // apply_chat_template(tokenize=True) encodes without adding special tokens.
        Ok(self.loaded.tokenizer.encode(&text, false)?)
    }

    fn run(&self, ids: &[u32], stream: bool) -> Result<Generation> {
        let tok = &self.loaded.tokenizer;
        let mut decoder = StreamDecoder::new(tok, true);
        let mut out = std::io::stdout().lock();
        let mut on_token = |id: u32| {
            if stream && let Ok(Some(piece)) = decoder.push(id) {
                let _ = out.write_all(piece.as_bytes());
                let _ = out.flush();
            }
            ControlFlow::Continue(())
        };
        let g = generate(&self.loaded.model, ids, &self.options, &mut on_token)?;
        if stream {
            if let Some(rest) = decoder.finish()? {
                print!("{rest}");
            }
            println!();
        }
        Ok(g)
    }

    fn record(&self, prompt: &str, ids: &[u32], g: &Generation) -> Result<serde_json::Value> {
        let text = self.loaded.tokenizer.decode(&g.generated_ids, true)?;
        let n = g.generated_ids.len();
        Ok(json!({
            "prompt": prompt,
            "prompt_ids": ids,
            "generated_ids": g.generated_ids,
            "text": text,
            "stop_reason": g.stop_reason,
            "prefill_seconds": g.prefill_seconds,
            "decode_tokens_per_second": decode_rate(n, g),
        }))
    }
}

/// Tokens per second after the first token (which comes from the prefill pass).
fn decode_rate(n: usize, g: &Generation) -> f64 {
    if n > 1 && g.decode_seconds > 0.0 {
        (n - 1) as f64 / g.decode_seconds
    } else {
        0.0
    }
}

pub fn run(args: GenerateArgs) -> Result<ExitCode> {
    let sampling = args.sampling()?;
    let loaded = LoadedModel::load(&args.model, args.dtype)?;
    let lora = match &args.lora {
        Some(dir) => {
            let adapter = PeftAdapter::read(dir)
                .and_then(|a| a.served_weights(&loaded.model))
                .with_context(|| format!("--lora {}", dir.display()))?;
            Some(Arc::new(adapter))
        }
        None => None,
    };
    let stop_token_ids = loaded.stop_token_ids(&args.model)?;
    let runner = Runner {
        loaded,
        options: GenerateOptions {
            max_new_tokens: args.max_new_tokens,
            sampling,
            stop_token_ids,
            lora,
        },
        chat: args.chat,
    };
    if let (Some(input), Some(output)) = (&args.input_file, &args.output_file) {
        return run_batch(&runner, input, output);
    }
    let prompt = args.prompt.as_deref().unwrap_or_default();
    let ids = runner.prompt_ids(prompt, args.system.as_deref())?;
    if args.json {
        let g = runner.run(&ids, false)?;
        println!("{}", runner.record(prompt, &ids, &g)?);
    } else {
        if !args.chat {
            print!("{prompt}");
        }
        let g = runner.run(&ids, true)?;
        eprintln!(
            "[{} prompt tokens, {} generated ({:?}); prefill {:.2} s, decode {:.1} tokens/s]",
            ids.len(),
            g.generated_ids.len(),
            g.stop_reason,
            g.prefill_seconds,
            decode_rate(g.generated_ids.len(), &g)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Processes every line of `input`; bad lines are reported with their number and skipped.
fn run_batch(runner: &Runner, input: &Path, output: &Path) -> Result<ExitCode> {
    let file =
        std::fs::File::open(input).with_context(|| format!("{}: cannot open", input.display()))?;
    let tmp = output.with_file_name(format!(
        ".{}.tmp-{}",
        output
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("output"),
        std::process::id()
    ));
    let mut writer = std::io::BufWriter::new(
        std::fs::File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?,
    );
    let (mut ok, mut bad) = (0usize, 0usize);
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let lineno = i + 1;
        let line =
            line.with_context(|| format!("{}: line {lineno}: cannot read", input.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        match batch_line(runner, &line) {
            Ok(mut rec) => {
                rec["line"] = json!(lineno);
                writeln!(writer, "{rec}")?;
                ok += 1;
            }
            Err(e) => {
                eprintln!("{}: line {lineno}: {e:#}", input.display());
                bad += 1;
            }
        }
    }
    writer.flush()?;
    drop(writer);
    std::fs::rename(&tmp, output)
        .with_context(|| format!("{}: cannot rename into place", output.display()))?;
    eprintln!(
        "{ok} prompts written to {}; {bad} bad lines skipped",
        output.display()
    );
    Ok(if bad > 0 {
        ExitCode::from(3)
    } else {
        ExitCode::SUCCESS
    })
}

fn batch_line(runner: &Runner, line: &str) -> Result<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(line).context("invalid JSON")?;
    let Some(prompt) = v.get("prompt").and_then(|p| p.as_str()) else {
        bail!("expected an object with a string field \"prompt\"");
    };
    let system = match v.get("system") {
        None | Some(serde_json::Value::Null) => None,
        Some(s) => Some(s.as_str().context("field \"system\" must be a string")?),
    };
    let ids = runner.prompt_ids(prompt, system)?;
    let g = runner.run(&ids, false)?;
    runner.record(prompt, &ids, &g)
}
