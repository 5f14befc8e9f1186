//! The ext_proc floor (bench, `make overhead`): the least an endpoint picker behind Envoy's
//! ext_proc filter can do. Envoy sends each request's headers, then its whole body (BUFFERED,
//! as the Gateway API Inference Extension's pickers ask for); this answers the headers with
//! "continue", parses the body as JSON (any router must read the prompt) and names the next
//! endpoint, round-robin, in `x-gateway-destination-endpoint`, which an ORIGINAL_DST cluster
//! connects to. No scoring, no state: whatever an ext_proc-based router (llm-d's EPP,
//! Dynamo's EPP, Envoy AI Gateway) does on top of this costs more.
//!
//! Messages of `envoy.service.ext_proc.v3.ExternalProcessor/Process`, only the fields used
//! (the field numbers of Envoy's API), derived with prost by hand as the relay does: no protoc.
//!
//! Usage: extproc_picker --listen 127.0.0.1:PORT --endpoints HOST:PORT[,HOST:PORT...]
//! `cargo build --release -p kvroute-relay --example extproc_picker`.

use kvroute_relay::streaming::{self, BoxFuture, OpenResult, StreamMethod};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

const HEADER: &str = "x-gateway-destination-endpoint";

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingRequest {
    #[prost(oneof = "Phase", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<Phase>,
}

/// What Envoy sends (headers are left unparsed: the floor does not look at them).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Phase {
    #[prost(message, tag = "2")]
    RequestHeaders(Empty),
    #[prost(message, tag = "3")]
    ResponseHeaders(Empty),
    #[prost(message, tag = "4")]
    RequestBody(HttpBody),
    #[prost(message, tag = "5")]
    ResponseBody(HttpBody),
    #[prost(message, tag = "6")]
    RequestTrailers(Empty),
    #[prost(message, tag = "7")]
    ResponseTrailers(Empty),
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpBody {
    #[prost(bytes = "vec", tag = "1")]
    pub body: Vec<u8>,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingResponse {
    #[prost(oneof = "Answer", tags = "1, 2, 3, 4, 5, 6")]
    pub response: Option<Answer>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Answer {
    #[prost(message, tag = "1")]
    RequestHeaders(Common),
    #[prost(message, tag = "2")]
    ResponseHeaders(Common),
    #[prost(message, tag = "3")]
    RequestBody(Common),
    #[prost(message, tag = "4")]
    ResponseBody(Common),
    #[prost(message, tag = "5")]
    RequestTrailers(Empty),
    #[prost(message, tag = "6")]
    ResponseTrailers(Empty),
}

/// HeadersResponse and BodyResponse: one CommonResponse at field 1.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Common {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CommonResponse {
    #[prost(message, optional, tag = "2")]
    pub header_mutation: Option<HeaderMutation>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMutation {
    #[prost(message, repeated, tag = "1")]
    pub set_headers: Vec<HeaderValueOption>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValueOption {
    #[prost(message, optional, tag = "1")]
    pub header: Option<HeaderValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(bytes = "vec", tag = "3")]
    pub raw_value: Vec<u8>,
}

/// The body fields a picker needs at the least (serde skips the rest but still checks it).
#[derive(serde::Deserialize)]
struct Body {
    #[allow(dead_code)]
    model: Option<String>,
}

#[derive(Clone)]
struct Picker {
    endpoints: Arc<Vec<String>>,
    next: Arc<AtomicUsize>,
}

impl Picker {
    fn answer(&self, phase: Phase) -> Result<ProcessingResponse, String> {
        let a = match phase {
            Phase::RequestHeaders(_) => Answer::RequestHeaders(Common::default()),
            Phase::ResponseHeaders(_) => Answer::ResponseHeaders(Common::default()),
            Phase::RequestBody(b) => {
                serde_json::from_slice::<Body>(&b.body).map_err(|e| format!("body: {e}"))?;
                let i = self.next.fetch_add(1, Ordering::Relaxed) % self.endpoints.len();
                let ep = self.endpoints.get(i).cloned().unwrap_or_default();
                let header = HeaderValue {
                    key: HEADER.into(),
                    raw_value: ep.into_bytes(),
                };
                Answer::RequestBody(Common {
                    response: Some(CommonResponse {
                        header_mutation: Some(HeaderMutation {
                            set_headers: vec![HeaderValueOption {
                                header: Some(header),
                            }],
                        }),
                    }),
                })
            }
            Phase::ResponseBody(_) => Answer::ResponseBody(Common::default()),
            Phase::RequestTrailers(_) => Answer::RequestTrailers(Empty {}),
            Phase::ResponseTrailers(_) => Answer::ResponseTrailers(Empty {}),
        };
        Ok(ProcessingResponse { response: Some(a) })
    }
}

impl StreamMethod for Picker {
    const SERVICE: &'static str = "envoy.service.ext_proc.v3.ExternalProcessor";
    const METHOD: &'static str = "Process";
    // A buffered 128k-token prompt is ~1 MiB: above tonic's 4 MiB default only for much
    // longer ones, allowed up to Envoy's own 32 MiB request buffer.
    const MAX_DECODING: Option<usize> = Some(64 << 20);
    type In = ProcessingRequest;
    type Out = ProcessingResponse;

    fn open(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> BoxFuture<OpenResult<ProcessingResponse>> {
        let picker = self.clone();
        Box::pin(async move {
            let mut inbound = request.into_inner();
            let (tx, rx) = mpsc::channel(4);
            tokio::spawn(async move {
                while let Ok(Some(m)) = inbound.message().await {
                    let Some(phase) = m.request else { continue };
                    let out = picker.answer(phase).map_err(Status::invalid_argument);
                    let stop = out.is_err();
                    if tx.send(out).await.is_err() || stop {
                        return;
                    }
                }
            });
            Ok(Response::new(ReceiverStream::new(rx)))
        })
    }
}

fn main() {
    let mut listen = None;
    let mut endpoints = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match (a.as_str(), args.next()) {
            ("--listen", Some(v)) => listen = Some(v),
            ("--endpoints", Some(v)) => endpoints = v.split(',').map(str::to_string).collect(),
            _ => {
                eprintln!(
                    "usage: extproc_picker --listen HOST:PORT --endpoints HOST:PORT[,HOST:PORT...]"
                );
                std::process::exit(2);
            }
        }
    }
    let (Some(listen), false) = (listen, endpoints.is_empty()) else {
        eprintln!("extproc_picker: --listen and --endpoints are required");
        std::process::exit(2);
    };
    let picker = Picker {
        endpoints: Arc::new(endpoints),
        next: Arc::new(AtomicUsize::new(0)),
    };
    // One worker thread: a picker is a small sidecar; its CPU is measured per request.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            eprintln!("extproc_picker: {e}");
            std::process::exit(1);
        });
    let res: Result<(), String> = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&listen)
            .await
            .map_err(|e| format!("{listen}: {e}"))?;
        streaming::serve(picker, listener, None).await
    });
    if let Err(e) = res {
        eprintln!("extproc_picker: {e}");
        std::process::exit(1);
    }
}
