# kvroute-relay as a registry-free image: one statically linked binary, nothing else.
# Built by scripts/build-images.sh (cargo --profile relay, +crt-static), which puts the binary
# next to this file in its context.
FROM scratch
COPY kvroute-relay /usr/local/bin/kvroute-relay
# Any unprivileged id works: the relay writes no files.
USER 65534:65534
# 7000: gRPC (kvroute.relay.v1.Relay/Watch) for the gateways; 7001: GET /metrics and /health.
EXPOSE 7000 7001
ENTRYPOINT ["/usr/local/bin/kvroute-relay"]
CMD ["--help"]
