package org.apache.spark.shuffle.hybridray;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;

/**
 * The map side's bookkeeping: cuts the byte stream of each reduce partition into sealed
 * segments of at most {@code segmentBytes} payload bytes and counts each partition's bytes
 * (the sizes {@code MapStatus} reports, which AQE's coalescing and skew splitting use).
 *
 * <p>Spark's sorter writes partitions in increasing order, each at most once, so one buffer
 * is open at a time. A frame is allocated for the bytes at hand (at most a segment), and
 * grows by doubling when more come: a partition written in one call (the direct writer's
 * flush) gets a frame of exactly its size, sealed in place without a copy. (Frames used to
 * be allocated at full segment size, 4 MiB, for every partition of every flush: a small
 * map task of 8 partitions zeroed 32 MiB of fresh heap, 200 partitions 800 MiB.)
 * Not thread-safe: one map task uses it.
 */
public final class PartitionSegmenter {

  /** A sealed segment: frame bytes (header + payload) of {@code partition}'s {@code index}-th. */
  public record Segment(int partition, int index, byte[] frame) {
    public int payloadBytes() {
      return frame.length - SegmentCodec.HEADER_BYTES;
    }
  }

  /** First frame size of a partition written in small pieces (the sort writer's stream). */
  static final int MIN_FRAME = 64 * 1024;

  private final String shuffleKey;
  private final long mapId;
  private final int segmentBytes;
  private final long[] lengths;
  private final int[] segmentCounts;
  private final List<Segment> pending = new ArrayList<>();
  private long pendingBytes;
  private int current = -1;
  private byte[] frame;
  private int filled;

  public PartitionSegmenter(String shuffleKey, long mapId, int numPartitions, int segmentBytes) {
    if (segmentBytes <= 0) {
      throw new IllegalArgumentException("segmentBytes must be positive, got " + segmentBytes);
    }
    this.shuffleKey = shuffleKey;
    this.mapId = mapId;
    this.segmentBytes = segmentBytes;
    this.lengths = new long[numPartitions];
    this.segmentCounts = new int[numPartitions];
  }

  /** Append bytes of {@code partition} (never one before the current one). */
  public void write(int partition, byte[] b, int off, int len) {
    open(partition);
    while (len > 0) {
      int n = Math.min(len, segmentBytes - (frame == null ? 0 : filled));
      reserve(n);
      System.arraycopy(b, off, frame, SegmentCodec.HEADER_BYTES + filled, n);
      filled += n;
      off += n;
      len -= n;
      lengths[partition] += n;
      if (filled == segmentBytes) {
        cut();
      }
    }
  }

  /** Room in the open frame for {@code n} more payload bytes (a new frame if none is open);
   *  the payload capacity at least doubles when it grows, up to a segment. */
  private void reserve(int n) {
    if (frame == null) {
      frame = new byte[SegmentCodec.HEADER_BYTES + Math.max(n, Math.min(MIN_FRAME, segmentBytes))];
      filled = 0;
      return;
    }
    int needed = filled + n;
    int capacity = frame.length - SegmentCodec.HEADER_BYTES;
    if (needed > capacity) {
      int grown = (int) Math.min(segmentBytes, Math.max(needed, 2L * capacity));
      frame = Arrays.copyOf(frame, SegmentCodec.HEADER_BYTES + grown);
    }
  }

  /** The partition's stream was closed: seal its last, partial segment. */
  public void finishPartition(int partition) {
    open(partition);
    if (frame != null && filled > 0) {
      if (frame.length != SegmentCodec.HEADER_BYTES + filled) {
        frame = Arrays.copyOf(frame, SegmentCodec.HEADER_BYTES + filled);
      }
      cut();
    }
    frame = null;
  }

  /**
   * Seal the open partition's partial segment and allow partitions from 0 again: a writer
   * that buffers every partition at once (see {@link HybridRayDirectWriter}) hands its
   * buffers over in rounds, each in increasing partition order. Segment indices go on.
   */
  public void startRound() {
    if (current >= 0) {
      finishPartition(current);
    }
    current = -1;
  }

  private void open(int partition) {
    if (partition < 0 || partition >= lengths.length) {
      throw new IllegalArgumentException("partition " + partition + " is outside [0, "
          + lengths.length + ")");
    }
    if (partition < current) {
      throw new IllegalStateException("partition " + partition + " written after partition "
          + current + ": Spark's sorter writes partitions in increasing order");
    }
    if (partition != current) {
      if (frame != null && filled > 0) {
        finishPartition(current);
      }
      frame = null;
      current = partition;
    }
  }

  private void cut() {
    int index = segmentCounts[current]++;
    SegmentCodec.seal(frame, filled, SegmentCodec.identity(shuffleKey, mapId, current, index));
    pending.add(new Segment(current, index, frame));
    pendingBytes += filled;
    frame = null;
    filled = 0;
  }

  /** Sealed segments not yet handed out, in order; the list is cleared. */
  public List<Segment> takePending() {
    List<Segment> out = new ArrayList<>(pending);
    pending.clear();
    pendingBytes = 0;
    return out;
  }

  /** Payload bytes of the sealed segments not yet handed out. */
  public long pendingBytes() {
    return pendingBytes;
  }

  /** Bytes written per partition so far. */
  public long[] partitionLengths() {
    return lengths.clone();
  }

  public long bytesWritten(int partition) {
    return lengths[partition];
  }

  public int segments(int partition) {
    return segmentCounts[partition];
  }
}
