//! `streambp-bench`: one backward per (mode, T) on a random model built from a config, reporting peak
//! bytes per phase (host: exact, counting allocator; CUDA: the device memory pool's high-water marks)
//! and seconds, with every mode measured side by side in one process.
//!
//! `cargo run --release -p streambp-bench -- --config benches/configs/qwen3-small.json --seq-lens 1024,2048`

mod args;
mod budget;
mod cpu;
mod measure;
mod peer;
mod peer_run;
mod predict;
mod report;
mod sweep;
mod world;
mod world_run;

use anyhow::bail;
use clap::Parser;
use streambp_core::memory::CountingAllocator;
use streambp_kernels::op_times;
use streambp_models::device::parse_dtype;
use streambp_models::Model;

use args::{check_world, model_config, Args};
use budget::print_max_t;
use measure::{trainings, warm_up};
use peer_run::compare_with_peer;
use predict::predict;
use report::{plot, print_heading, print_lora_against_full, print_table};
use sweep::sweep;
use world_run::run_ranks;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

fn main() -> anyhow::Result<()> {
    settle_process()?;
    let args = Args::parse();
    if let Some(ranks) = args.world {
        check_world(&args, ranks)?;
        if let Some(status) = world::relaunch(ranks)? {
            std::process::exit(status.code().unwrap_or(1));
        }
    }
    let dtype = parse_dtype(&args.dtype)?;
    let cfg = model_config(&args)?;
    if args.predict {
        return predict(&cfg, dtype, &args);
    }
    op_times::switch(args.op_times);
    let device = args::device(&args)?;
    // Seeded: every rank builds the same weights.
    let model = Model::random(cfg, dtype, &device, 0)?;
    if let Some(ranks) = args.world {
        return run_ranks(&args, &model, ranks);
    }
    if args.sp != 1 {
        bail!("--sp {}: needs --world", args.sp);
    }
    let params: usize = model.parameters().iter().map(|(_, v)| v.elem_count()).sum();
    print_heading(&args, &model, dtype, params);
    let trainings = trainings(&args, &model)?;
    warm_up(&model)?;
    if let Some(python) = &args.peer {
        return compare_with_peer(&args, &model, python);
    }
    if let Some(budget) = args.max_t_budget {
        return print_max_t(&args, &trainings, budget);
    }
    let (points, out_of_memory) = sweep(&args, &trainings)?;
    print_table(&args, &model, dtype, &trainings, &points, &out_of_memory);
    print_lora_against_full(&model, params, &points);
    if let Some(dir) = &args.plot {
        plot(&args, &trainings, &points, dir)?;
    }
    Ok(())
}

/// Process-wide settings made before anything else runs: threads, freed memory and the host kernels.
fn settle_process() -> anyhow::Result<()> {
    // Ranks sharing a node share its cores (set before any thread pool starts).
    if let Some(threads) = streambp_dist::threads_per_rank() {
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    }
    streambp_core::settle_thread_settings();
    streambp_core::memory::keep_freed_memory();
    // The host kernels the STREAMBP_SIMD and STREAMBP_BF16_KERNEL switches name (a value the CPU
    // cannot run is reported and left to the CPU), fixed before the first product.
    {
        use streambp_kernels::choices::{self, KERNEL_ENV, SIMD_ENV};
        let switch = |name| std::env::var(name).ok();
        let asked = choices::Choices::from_switches(
            switch(SIMD_ENV).as_deref(),
            switch(KERNEL_ENV).as_deref(),
        );
        choices::choose(asked)?;
    }
    Ok(())
}
