# The mock worker as a registry-free image: one statically linked binary, nothing else.
# Built by scripts/build-images.sh, which puts the binary next to this file in its context.
FROM scratch
COPY mock-worker /usr/local/bin/mock-worker
# Any unprivileged id works: the worker writes no files.
USER 65534:65534
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/mock-worker"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
