package org.apache.spark.shuffle.hybridray;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertSame;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.OutputStream;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import org.junit.jupiter.api.Test;

class HybridRayMapOutputWriterTest {
  private static final String KEY = "spark-app-1-0";

  /** Records what the writer hands over, batch by batch. */
  static final class FakeSink implements SegmentSink {
    final List<List<PartitionSegmenter.Segment>> batches = new ArrayList<>();
    final List<Boolean> lastFlags = new ArrayList<>();
    Throwable aborted;
    IOException failOnBatch;
    int failAt = -1;
    int calls;

    @Override
    public void store(List<PartitionSegmenter.Segment> segments, boolean last)
        throws IOException {
      calls++;
      if (batches.size() == failAt) {
        throw failOnBatch;
      }
      batches.add(segments);
      lastFlags.add(last);
    }

    @Override
    public void abort(Throwable cause) {
      aborted = cause;
    }

    List<PartitionSegmenter.Segment> all() {
      List<PartitionSegmenter.Segment> out = new ArrayList<>();
      batches.forEach(out::addAll);
      return out;
    }
  }

  private static byte[] bytes(int n, int seed) {
    byte[] b = new byte[n];
    for (int i = 0; i < n; i++) {
      b[i] = (byte) (i * 31 + seed);
    }
    return b;
  }

  private static void writePartition(HybridRayMapOutputWriter w, int p, byte[] data, int chunk)
      throws IOException {
    try (OutputStream out = w.getPartitionWriter(p).openStream()) {
      for (int off = 0; off < data.length; off += chunk) {
        out.write(data, off, Math.min(chunk, data.length - off));
      }
    }
  }

  /** The payloads of a partition's segments, concatenated in index order. */
  private static byte[] reassemble(List<PartitionSegmenter.Segment> segs, int partition)
      throws IOException {
    ByteArrayOutputStream out = new ByteArrayOutputStream();
    int expected = 0;
    for (PartitionSegmenter.Segment s : segs) {
      if (s.partition() != partition) {
        continue;
      }
      assertEquals(expected++, s.index());
      int n = SegmentCodec.verify(s.frame(),
          SegmentCodec.identity(KEY, 9L, partition, s.index()), "test");
      out.write(s.frame(), SegmentCodec.HEADER_BYTES, n);
    }
    return out.toByteArray();
  }

  @Test
  void partitionLengthsAndSegmentsMatchWhatWasWritten() throws IOException {
    FakeSink sink = new FakeSink();
    HybridRayMapOutputWriter w = new HybridRayMapOutputWriter(
        new PartitionSegmenter(KEY, 9L, 5, 100), sink, 1_000_000);
    byte[] p0 = bytes(250, 1);
    byte[] p3 = bytes(100, 2);
    byte[] p4 = bytes(7, 3);
    writePartition(w, 0, p0, 33);
    writePartition(w, 3, p3, 100);
    writePartition(w, 4, p4, 1);
    long[] lengths = w.commitAllPartitions(new long[0]).getPartitionLengths();
    assertArrayEquals(new long[] {250, 0, 0, 100, 7}, lengths);
    // One batch (below flushBytes), marked last; 250 bytes -> 100 + 100 + 50.
    assertEquals(List.of(true), sink.lastFlags);
    List<PartitionSegmenter.Segment> segs = sink.all();
    assertEquals(List.of(100, 100, 50, 100, 7),
        segs.stream().map(PartitionSegmenter.Segment::payloadBytes).toList());
    assertArrayEquals(p0, reassemble(segs, 0));
    assertArrayEquals(p3, reassemble(segs, 3));
    assertArrayEquals(p4, reassemble(segs, 4));
    assertArrayEquals(new byte[0], reassemble(segs, 1));
    assertTrue(w.isCommitted());
    assertNull(sink.aborted);
  }

  @Test
  void largeOutputIsStoredInBatchesEvenInsideOnePartition() throws IOException {
    FakeSink sink = new FakeSink();
    HybridRayMapOutputWriter w = new HybridRayMapOutputWriter(
        new PartitionSegmenter(KEY, 9L, 2, 64), sink, 256);
    byte[] skewed = bytes(1000, 5);
    writePartition(w, 1, skewed, 50);
    w.commitAllPartitions(new long[0]);
    assertTrue(sink.batches.size() >= 3, "batches: " + sink.batches.size());
    for (int i = 0; i < sink.batches.size() - 1; i++) {
      assertFalse(sink.lastFlags.get(i));
      int batchBytes = sink.batches.get(i).stream()
          .mapToInt(PartitionSegmenter.Segment::payloadBytes).sum();
      assertTrue(batchBytes >= 256 && batchBytes < 256 + 64, "batch of " + batchBytes);
    }
    assertTrue(sink.lastFlags.get(sink.lastFlags.size() - 1));
    assertArrayEquals(skewed, reassemble(sink.all(), 1));
  }

  @Test
  void partitionsMustComeInOrder() throws IOException {
    HybridRayMapOutputWriter w = new HybridRayMapOutputWriter(
        new PartitionSegmenter(KEY, 9L, 4, 64), new FakeSink(), 1 << 20);
    writePartition(w, 2, bytes(10, 0), 10);
    var e = assertThrows(IllegalStateException.class,
        () -> writePartition(w, 1, bytes(10, 0), 10));
    assertTrue(e.getMessage().contains("increasing order"), e.getMessage());
    assertThrows(IllegalArgumentException.class, () -> writePartition(w, 4, bytes(1, 0), 1));
  }

  @Test
  void aFailedStoreAbortsTheAttemptAndItCannotCommit() throws IOException {
    FakeSink sink = new FakeSink();
    sink.failAt = 1;
    sink.failOnBatch = new IOException("no tier can take a segment");
    HybridRayMapOutputWriter w = new HybridRayMapOutputWriter(
        new PartitionSegmenter(KEY, 9L, 2, 64), sink, 128);
    IOException e = assertThrows(IOException.class,
        () -> writePartition(w, 0, bytes(1000, 1), 100));
    assertSame(sink.failOnBatch, e);
    assertSame(sink.failOnBatch, sink.aborted);
    assertEquals(1, sink.batches.size());  // the first batch was stored, then aborted
    assertThrows(IOException.class, () -> w.commitAllPartitions(new long[0]));
    assertFalse(w.isCommitted());
  }

  @Test
  void anAbortedAttemptStoresNothingMoreWhenItsStreamIsClosed() {
    // Spark closes the partition's stream after a failed store; with a small flush size
    // that flushed again, writing (and committing) segments of an aborted attempt.
    FakeSink sink = new FakeSink();
    sink.failAt = 1;
    sink.failOnBatch = new IOException("no tier can take a segment");
    HybridRayMapOutputWriter w = new HybridRayMapOutputWriter(
        new PartitionSegmenter(KEY, 9L, 2, 64), sink, 1);
    assertThrows(IOException.class, () -> writePartition(w, 0, bytes(1000, 1), 100));
    assertSame(sink.failOnBatch, sink.aborted);
    assertEquals(2, sink.calls, "stores after the abort");
    assertEquals(1, sink.batches.size());
  }

  @Test
  void aRefusalAfterAnAbortNamesTheAbortsCause() throws IOException {
    // Spark's task failure listener aborts with the task's error; a commit or a close
    // refused afterwards said only "aborted", hiding the failure that caused it.
    FakeSink sink = new FakeSink();
    HybridRayMapOutputWriter w = new HybridRayMapOutputWriter(
        new PartitionSegmenter(KEY, 9L, 2, 64), sink, 1);
    OutputStream out = w.getPartitionWriter(0).openStream();
    RuntimeException cause = new RuntimeException("executor lost its upstream input");
    w.abort(cause);
    IOException refusedWrite = assertThrows(IOException.class,
        () -> out.write(bytes(100, 1), 0, 100));
    assertSame(cause, refusedWrite.getCause());
    IOException refusedCommit = assertThrows(IOException.class,
        () -> w.commitAllPartitions(new long[0]));
    assertSame(cause, refusedCommit.getCause());
  }

  @Test
  void abortAfterCommitKeepsTheOutput() throws IOException {
    FakeSink sink = new FakeSink();
    HybridRayMapOutputWriter w = new HybridRayMapOutputWriter(
        new PartitionSegmenter(KEY, 9L, 1, 64), sink, 1 << 20);
    writePartition(w, 0, bytes(10, 1), 10);
    w.commitAllPartitions(new long[0]);
    w.abort(new RuntimeException("task failed later"));
    assertNull(sink.aborted);
  }

  @Test
  void segmentFileLayoutMatchesTheDiskTier() {
    // hybrid_ray/tiers/disk.py: <spill>/hybrid_ray/<shuffle>/sub-%05d/m%06d-a%03d-s%06d.seg
    assertEquals("/spill/hybrid_ray/spark-app-1-0/sub-00003/m000012-a123456-s000002.seg",
        RaySegmentSink.segmentPath("/spill", KEY, 12, 123456L, 3, 2).toString());
    assertEquals(Arrays.asList("app-2026_1", "x".repeat(80)),
        Arrays.asList(HybridRayContext.appKey("app-2026/1"),
            HybridRayContext.appKey("y" + "x".repeat(80))));
  }

  @Test
  void sessionsUnderOneApplicationIdGetApartShuffleIds() {
    // spark_bridge's token: "s" + 32 hex digits; the tag is its SHA-256's first 8 hex
    // digits (the Python side takes the same), none of the token's own characters.
    com.fasterxml.jackson.databind.ObjectMapper json =
        new com.fasterxml.jackson.databind.ObjectMapper();
    assertEquals("acbe04b0", HybridRayContext.sessionTag(json.createObjectNode()
        .put("session_token", "s0123456789abcdef0123456789abcdef").put("namespace", "ns")));
    // No token (RayDP started by hand) or no config: random per driver, never shared.
    String first = HybridRayContext.sessionTag(json.createObjectNode());
    String second = HybridRayContext.sessionTag(null);
    assertEquals(8, first.length());
    assertNotEquals(first, second);
  }
}
