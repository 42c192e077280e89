package org.apache.spark.shuffle.hybridray;

import java.io.IOException;
import java.io.OutputStream;
import org.apache.spark.shuffle.api.ShuffleMapOutputWriter;
import org.apache.spark.shuffle.api.ShufflePartitionWriter;
import org.apache.spark.shuffle.api.metadata.MapOutputCommitMessage;

/**
 * One map attempt's output, as Spark's {@code SortShuffleWriter} produces it through the
 * shuffle I/O plugin API: the sorter opens one stream per non-empty reduce partition, in
 * order, and writes the partition's records serialized and compressed by Spark. Bytes are
 * cut into segments ({@link PartitionSegmenter}) and handed to the {@link SegmentSink} in
 * batches of about {@code flushBytes}, so a large map never holds its whole output in memory
 * and each batch costs one space reservation and one commit.
 */
public final class HybridRayMapOutputWriter implements ShuffleMapOutputWriter {
  private final PartitionSegmenter segmenter;
  private final SegmentSink sink;
  private final long flushBytes;
  private boolean committed;
  private boolean aborted;
  // Why the attempt was aborted: the cause of every later refusal, so a commit or flush
  // refused after an abort names the failure that caused it, not only "aborted".
  private Throwable abortCause;

  public HybridRayMapOutputWriter(PartitionSegmenter segmenter, SegmentSink sink,
      long flushBytes) {
    this.segmenter = segmenter;
    this.sink = sink;
    this.flushBytes = flushBytes;
  }

  @Override
  public ShufflePartitionWriter getPartitionWriter(int reducePartitionId) {
    return new PartitionWriter(reducePartitionId);
  }

  @Override
  public MapOutputCommitMessage commitAllPartitions(long[] checksums) throws IOException {
    if (aborted) {
      throw new IOException("map output was aborted; it cannot be committed", abortCause);
    }
    store(true);
    committed = true;
    return MapOutputCommitMessage.of(segmenter.partitionLengths());
  }

  @Override
  public void abort(Throwable error) {
    if (committed || aborted) {
      return;
    }
    aborted = true;
    abortCause = error;
    sink.abort(error);
  }

  /** Whether the attempt's output was committed (a later failure leaves it in place). */
  public boolean isCommitted() {
    return committed;
  }

  private void store(boolean last) throws IOException {
    if (aborted) {
      // Spark still closes the partition's stream after a failed store, which can flush
      // again: the aborted attempt must not write (and commit) more segments.
      throw new IOException("map output was aborted; nothing more is stored for it",
          abortCause);
    }
    try {
      sink.store(segmenter.takePending(), last);
    } catch (IOException | RuntimeException e) {
      abort(e);
      throw e;
    }
  }

  private final class PartitionWriter implements ShufflePartitionWriter {
    private final int partition;

    PartitionWriter(int partition) {
      this.partition = partition;
    }

    @Override
    public OutputStream openStream() {
      return new OutputStream() {
        private boolean closed;

        @Override
        public void write(int b) throws IOException {
          write(new byte[] {(byte) b}, 0, 1);
        }

        @Override
        public void write(byte[] b, int off, int len) throws IOException {
          if (closed) {
            throw new IllegalStateException("stream of partition " + partition + " is closed");
          }
          segmenter.write(partition, b, off, len);
          // Also mid-partition: a skewed partition must not sit in memory whole.
          if (segmenter.pendingBytes() >= flushBytes) {
            store(false);
          }
        }

        @Override
        public void close() throws IOException {
          if (closed) {
            return;
          }
          closed = true;
          segmenter.finishPartition(partition);
          if (segmenter.pendingBytes() >= flushBytes) {
            store(false);
          }
        }
      };
    }

    @Override
    public long getNumBytesWritten() {
      return segmenter.bytesWritten(partition);
    }
  }
}
