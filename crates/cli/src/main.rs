//! `dflash`: the command-line surface of dflash-rs (no model math here).

mod args;
mod bench;
mod bench_load;
mod bench_probe;
mod bench_verify;
mod eval;
mod generate;
mod load;
mod microbench;
mod output;
mod paths;
mod progress;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// dflash-rs: LLM inference with DFlash block-diffusion speculative decoding.
#[derive(Parser, Debug)]
#[command(name = "dflash", version, about)]
struct Cli {
    /// Log more (-v: info, -vv: debug); DFLASH_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate a completion for one prompt (argument or stdin).
    Generate(generate::GenerateArgs),
    /// Measure prefill and decode throughput.
    Bench(bench::BenchArgs),
    /// Measure drafter acceptance (tau, acceptance by block slot) over a prompt set.
    Eval(eval::EvalArgs),
    /// Time the CPU matmul kernels alone (int8 vs f32 paths) against the machine's peaks.
    Microbench(microbench::MicrobenchArgs),
    /// Serve the OpenAI API (chat and completions, streaming, metrics) with continuous
    /// batching and DFlash speculative decoding.
    Serve(serve::ServeArgs),
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("DFLASH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Microbench(a) => microbench::run(a),
        Command::Serve(a) => serve::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of our output left (`dflash generate … | head`): nothing to report.
        Err(e) if e.is::<output::ClosedPipe>() => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
