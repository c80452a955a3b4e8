//! What every accepted connection carries on both listeners: its place among
//! `--max-connections` of that listener ([`Slots`]), so that idle sockets
//! cannot exhaust the process's file descriptors, and, on the gRPC listener,
//! an idle deadline ([`Guarded`]): HTTP/2 has no header read timeout, so a
//! connection that neither reads nor writes for `--header-timeout-ms` is
//! closed, as the HTTP listener closes an idle keep-alive connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus::IntCounter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

/// The connections one listener may hold open at once.
#[derive(Clone)]
pub struct Slots {
    free: Arc<Semaphore>,
    refused: IntCounter,
}

impl Slots {
    /// `max` places; a connection turned away is counted in `refused`.
    pub fn new(max: usize, refused: IntCounter) -> Slots {
        Slots {
            free: Arc::new(Semaphore::new(max)),
            refused,
        }
    }

    /// A place for a connection just accepted, held until it closes; `None`
    /// (counted): the listener is full and the connection is to be closed.
    pub fn take(&self) -> Option<OwnedSemaphorePermit> {
        match Arc::clone(&self.free).try_acquire_owned() {
            Ok(permit) => Some(permit),
            Err(_) => {
                self.refused.inc();
                None
            }
        }
    }
}

/// A connection with its place and an idle deadline: a read that waits
/// past `idle` since the last byte read or written fails with `TimedOut`,
/// which ends the connection.
pub struct Guarded<T> {
    io: T,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    _slot: OwnedSemaphorePermit,
}

impl<T> Guarded<T> {
    /// `io`, holding `slot`, closed after `idle` without traffic.
    pub fn new(io: T, slot: OwnedSemaphorePermit, idle: Duration) -> Guarded<T> {
        Guarded {
            io,
            idle,
            deadline: Box::pin(tokio::time::sleep(idle)),
            _slot: slot,
        }
    }

    fn touch(&mut self) {
        let next = Instant::now() + self.idle;
        self.deadline.as_mut().reset(next);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Guarded<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.touch();
                }
                Poll::Ready(r)
            }
            Poll::Pending => match self.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connection idle past --header-timeout-ms",
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Guarded<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<T> tonic::transport::server::Connected for Guarded<T> {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}
