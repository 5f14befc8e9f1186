use mock_worker::{config::HELP, Config};

fn main() {
    let cfg = match Config::from_args(std::env::args().skip(1)) {
        Ok(Some(c)) => c,
        Ok(None) => {
            print!("{HELP}");
            return;
        }
        Err(e) => {
            eprintln!("mock-worker: {e}");
            std::process::exit(2);
        }
    };
    // One thread by default: the engine is one loop, and a single-threaded runtime is the
    // cheapest way to serve hundreds of streams from one core.
    let rt = if cfg.threads == 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.threads)
            .enable_all()
            .build()
    }
    .expect("tokio runtime");
    rt.block_on(async move {
        let h = match mock_worker::start(cfg.clone()).await {
            Ok(h) => h,
            Err(e) => {
                eprintln!("mock-worker: cannot listen on {}:{}: {e}", cfg.host, cfg.port);
                std::process::exit(1);
            }
        };
        let cfg = &h.shared.cfg;
        eprintln!(
            "mock-worker {} listening on http://{} model={} role={} block_size={} kv_blocks={} max_batched_tokens={} \
             max_num_seqs={} max_model_len={} speedup={} decode_endpoint_header={} kv_bytes_per_token={} \
             kv_transfer_bandwidth={} threads={} accept_any_model={} preset={} enable_prompt_tokens_details={} \
             orca_on_stream={} context_attention={} cache_at_pass_end={}",
            h.name, h.addr, cfg.model, cfg.role, cfg.block_size, cfg.kv_blocks, cfg.max_batched_tokens,
            cfg.max_num_seqs, cfg.max_model_len, cfg.speedup, cfg.decode_endpoint_header, cfg.kv_bytes_per_token,
            cfg.kv_transfer_bandwidth, cfg.threads, cfg.accept_any_model, cfg.preset,
            cfg.enable_prompt_tokens_details, cfg.orca_on_stream, cfg.context_attention, cfg.cache_at_pass_end
        );
        if let Some(ep) = &h.kv_events {
            eprintln!(
                "mock-worker: KV cache events on {} topic={:?} replay={} buffer={} format={}",
                ep.publish,
                cfg.kv_events_topic,
                ep.replay.as_deref().unwrap_or("off"),
                cfg.kv_events_buffer,
                cfg.kv_events_format
            );
        }
        // SIGINT and SIGTERM end the process with their default action; nothing to flush.
        std::future::pending::<()>().await;
    });
}
