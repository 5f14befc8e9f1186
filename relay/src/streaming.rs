//! A gRPC service of one bidirectional-streaming method, served on tonic's server machinery
//! written by hand (no protoc, no codegen). The relay's Watch (`grpc`) and the bench's
//! ext_proc picker (examples/extproc_picker.rs) are both this shape; what differs between
//! them is the method, its messages, whether callers must authenticate and how large a
//! message may be.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio_stream::wrappers::ReceiverStream;
use tonic::body::BoxBody;
use tonic::codec::ProstCodec;
use tonic::{Request, Response, Status, Streaming};

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// The messages a method sends back, fed through a channel by the task serving the stream.
pub type Replies<T> = ReceiverStream<Result<T, Status>>;

/// One streaming method, cloned per call.
pub trait StreamMethod: Clone + Send + 'static {
    /// The gRPC service name (`package.Service`).
    const SERVICE: &'static str;
    /// The method's name: a call to any other path than `/SERVICE/METHOD` is `UNIMPLEMENTED`.
    const METHOD: &'static str;
    /// The largest request message tonic decodes (tonic's default: 4 MiB).
    const MAX_DECODING: Option<usize> = None;
    type In: prost::Message + Default + Send + 'static;
    type Out: prost::Message + Send + 'static;

    /// Refuses a call from its headers, before its path is looked at or anything it sends
    /// is read.
    fn admit(&self, _headers: &http::HeaderMap) -> Result<(), Box<Status>> {
        Ok(())
    }

    /// Starts serving one call.
    fn open(&self, request: Request<Streaming<Self::In>>) -> BoxFuture<OpenResult<Self::Out>>;
}

pub type OpenResult<T> = Result<Response<Replies<T>>, Status>;

/// A [`StreamMethod`] as the service tonic's `Server::add_service` takes.
#[derive(Clone)]
pub struct Served<M>(pub M);

impl<M: StreamMethod> tonic::server::NamedService for Served<M> {
    const NAME: &'static str = M::SERVICE;
}

impl<M, B> tower_service::Service<http::Request<B>> for Served<M>
where
    M: StreamMethod,
    B: http_body::Body + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<BoxBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = self.0.clone();
        let admitted = method.admit(req.headers());
        Box::pin(async move {
            if let Err(refused) = admitted {
                return Ok(refused.into_http());
            }
            let path = req.uri().path();
            if !names(path, M::SERVICE, M::METHOD) {
                let msg = format!("unknown method {path}");
                return Ok(Status::unimplemented(msg).into_http());
            }
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<M::Out, M::In>::default());
            if let Some(max) = M::MAX_DECODING {
                grpc = grpc.max_decoding_message_size(max);
            }
            Ok(grpc.streaming(Call(method), req).await)
        })
    }
}

/// Whether a request path is `/service/method` (compared in place: the ext_proc floor's
/// every request passes here).
fn names(path: &str, service: &str, method: &str) -> bool {
    path.strip_prefix('/').and_then(|p| p.split_once('/')) == Some((service, method))
}

/// What `tonic::server::Grpc::streaming` calls once the request is decoded.
struct Call<M>(M);

impl<M: StreamMethod> tonic::server::StreamingService<M::In> for Call<M> {
    type Response = M::Out;
    type ResponseStream = Replies<M::Out>;
    type Future = BoxFuture<OpenResult<M::Out>>;

    fn call(&mut self, request: Request<Streaming<M::In>>) -> Self::Future {
        self.0.open(request)
    }
}

/// Serves `method` on `listener` (HTTP/2 prior knowledge, as Envoy's gRPC client speaks it).
pub async fn serve<M: StreamMethod>(
    method: M,
    listener: tokio::net::TcpListener,
    http2_keepalive: Option<Duration>,
) -> Result<(), String> {
    // TCP_NODELAY on every accepted connection (Server::tcp_nodelay applies only to the
    // listeners tonic binds itself): small messages must not wait for delayed ACKs.
    let incoming = tonic::transport::server::TcpIncoming::from_listener(listener, true, None)
        .map_err(|e| e.to_string())?;
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(http2_keepalive)
        .add_service(Served(method))
        .serve_with_incoming(incoming)
        .await
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::names;

    #[test]
    fn only_the_one_path_is_the_method() {
        let (s, m) = ("kvroute.relay.v1.Relay", "Watch");
        assert!(names("/kvroute.relay.v1.Relay/Watch", s, m));
        for other in [
            "/kvroute.relay.v1.Relay/Other",
            "/kvroute.relay.v1.Relay/Watch/",
            "/kvroute.relay.v1.Relay/WatchX",
            "/kvroute.relay.v1.Relay",
            "kvroute.relay.v1.Relay/Watch",
            "//kvroute.relay.v1.Relay/Watch",
            "/other.Service/Watch",
            "",
        ] {
            assert!(!names(other, s, m), "{other}");
        }
    }
}
