//! `dflash serve`: the OpenAI-compatible server (dflash-server) over the model, drafter and
//! device the same flags as `generate` choose.

use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;
use dflash_engine::prefill::DEFAULT_BATCH_TOKENS;
use dflash_server::scheduler::SchedulerLimits;
use dflash_server::{HttpLimits, ServedModel, ServerConfig};

use crate::args::{DraftArgs, ModelArgs, Speculation};
use crate::load::load;

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// The model name clients pass as `model` (default: the model's own name).
    #[arg(long)]
    pub alias: Option<String>,
    /// Most requests decoding together (others wait in the queue and join between rounds).
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Token budget of one decoding step: the live rows' own tokens, then pieces of new
    /// requests' prompts in the rest (chunked prefill: rows join while others decode), but
    /// always at least a quarter of it for those pieces, so requests join even while the live
    /// rows' verify blocks fill it (a step then runs up to their tokens plus that quarter).
    #[arg(long, default_value_t = DEFAULT_BATCH_TOKENS)]
    pub max_batch_tokens: usize,
    /// Most requests waiting for a row; more are answered 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Largest request body in bytes (more: 413).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a request may take from arrival to its last token (more: 504).
    #[arg(long, default_value_t = 600)]
    pub request_timeout: u64,
    /// Seconds running requests get to finish after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 10)]
    pub shutdown_grace: u64,
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.max_batch == 0 {
        bail!("--max-batch must be at least 1");
    }
    if args.max_batch_tokens == 0 {
        bail!("--max-batch-tokens must be at least 1");
    }
    if args.max_body_bytes < 1024 {
        bail!("--max-body-bytes must be at least 1024");
    }
    if args.request_timeout == 0 {
        bail!("--request-timeout must be at least 1 second");
    }
    let config = ServerConfig {
        host: args.host,
        port: args.port,
        model_id: args.alias,
        scheduler: SchedulerLimits {
            max_batch: args.max_batch,
            max_queue: args.max_queue,
            max_batch_tokens: args.max_batch_tokens,
        },
        http: HttpLimits {
            max_body_bytes: args.max_body_bytes,
            request_timeout: Duration::from_secs(args.request_timeout),
        },
        shutdown_grace: Duration::from_secs(args.shutdown_grace),
    };
    let model = args.model;
    // Like `generate`: greedy batches draft only while drafting is measured to pay.
    let mut draft = args.draft;
    draft.speculation.get_or_insert(Speculation::Auto);
    dflash_server::serve(config, move || {
        let loaded = load(&model, &draft)?;
        tracing::info!(model = %loaded.name, device = %loaded.device, "serving");
        Ok(ServedModel {
            decoder: loaded.decoder,
            tokenizer: loaded.tokenizer,
            template: loaded.template,
            name: loaded.name,
        })
    })
}
